//! Egress policies: what a sandbox may reach, parsed from the API's `network` field.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// A sandbox's egress policy (serialized in the record of a sandbox kept across a
/// restart of the server).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Policy {
    /// Loopback only: no interface at all (or, on a running sandbox, everything refused).
    Off,
    /// Everything outbound through NAT, except link-local addresses (cloud metadata).
    Full,
    /// Outbound only to these destinations.
    Allow(Vec<Rule>),
}

/// One entry of an allow-list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Rule {
    /// An IPv4 network (a single address is a /32), optionally one port (TCP and UDP).
    Net {
        /// Network address (host bits cleared).
        addr: Ipv4Addr,
        /// Prefix length.
        prefix: u8,
        /// Only this destination port, when set.
        port: Option<u16>,
    },
    /// A domain name, reachable at the addresses dsec's resolver answered for it.
    Domain {
        /// The name, lower case; with `wildcard`, the parent of the allowed names.
        name: String,
        /// `*.name`: any name below `name` (not `name` itself).
        wildcard: bool,
        /// Only this destination port, when set.
        port: Option<u16>,
    },
}

/// A malformed allow-list entry.
#[derive(Debug, thiserror::Error)]
#[error("network rule {rule:?} is invalid: {reason}")]
pub struct RuleError {
    /// The entry as given.
    pub rule: String,
    /// What is wrong with it.
    pub reason: String,
}

impl Policy {
    /// Parses an allow-list; every entry must be valid.
    pub fn allow<S: AsRef<str>>(rules: &[S]) -> Result<Policy, RuleError> {
        rules
            .iter()
            .map(|r| Rule::parse(r.as_ref()))
            .collect::<Result<Vec<_>, _>>()
            .map(Policy::Allow)
    }

    /// Whether the sandbox needs an interface at all.
    pub fn is_off(&self) -> bool {
        matches!(self, Policy::Off)
    }

    /// The ports a DNS answer for `qname` opens: `Some(None)` for every port, `Some(ports)`
    /// for only those, `None` when the name is not allowed.
    pub(crate) fn domain_ports(&self, qname: &str) -> Option<Option<Vec<u16>>> {
        let rules = match self {
            Policy::Off => return None,
            Policy::Full => return Some(None),
            Policy::Allow(rules) => rules,
        };
        let qname = qname.trim_end_matches('.').to_ascii_lowercase();
        let mut ports = Vec::new();
        for rule in rules {
            if let Rule::Domain {
                name,
                wildcard,
                port,
            } = rule
            {
                let hit = if *wildcard {
                    qname
                        .strip_suffix(name.as_str())
                        .is_some_and(|head| head.ends_with('.') && head.len() > 1)
                } else {
                    qname == *name
                };
                match (hit, port) {
                    (true, None) => return Some(None),
                    (true, Some(p)) => ports.push(*p),
                    (false, _) => {}
                }
            }
        }
        (!ports.is_empty()).then_some(Some(ports))
    }
}

fn bad(rule: &str, reason: impl Into<String>) -> RuleError {
    RuleError {
        rule: rule.to_owned(),
        reason: reason.into(),
    }
}

impl Rule {
    /// Parses `1.2.3.4`, `10.0.0.0/8`, `1.2.3.4:443`, `10.0.0.0/8:53`, `pypi.org`,
    /// `pypi.org:443`, `*.pythonhosted.org`.
    pub fn parse(rule: &str) -> Result<Rule, RuleError> {
        let text = rule.trim();
        if text.is_empty() {
            return Err(bad(rule, "it is empty"));
        }
        if text.starts_with('[') || text.matches(':').count() > 1 {
            return Err(bad(
                rule,
                "IPv6 destinations are not supported: sandboxes have IPv4 only",
            ));
        }
        let (host, port) = match text.split_once(':') {
            Some((h, p)) => {
                let port: u16 = p
                    .parse()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| bad(rule, format!("port {p:?} is not a number 1-65535")))?;
                (h, Some(port))
            }
            None => (text, None),
        };
        if let Some((addr, prefix)) = host.split_once('/') {
            let addr: Ipv4Addr = addr
                .parse()
                .map_err(|_| bad(rule, format!("{addr:?} is not an IPv4 address")))?;
            let prefix: u8 = prefix
                .parse()
                .ok()
                .filter(|p| *p <= 32)
                .ok_or_else(|| bad(rule, format!("prefix {prefix:?} is not 0-32")))?;
            let mask = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - prefix)
            };
            return Ok(Rule::Net {
                addr: Ipv4Addr::from(u32::from(addr) & mask),
                prefix,
                port,
            });
        }
        if let Ok(addr) = host.parse::<Ipv4Addr>() {
            return Ok(Rule::Net {
                addr,
                prefix: 32,
                port,
            });
        }
        let (wildcard, name) = match host.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, host),
        };
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if name.len() > 253 || !name.split('.').all(label_ok) {
            return Err(bad(
                rule,
                "expected an IPv4 address, a CIDR, a domain name or *.domain, each with an optional :port",
            ));
        }
        if name
            .split('.')
            .all(|l| l.bytes().all(|b| b.is_ascii_digit()))
        {
            return Err(bad(rule, "not a valid IPv4 address"));
        }
        Ok(Rule::Domain {
            name,
            wildcard,
            port,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        assert_eq!(
            Rule::parse("10.1.2.3/8").unwrap(),
            Rule::Net {
                addr: Ipv4Addr::new(10, 0, 0, 0),
                prefix: 8,
                port: None
            }
        );
        assert_eq!(
            Rule::parse("1.2.3.4:443").unwrap(),
            Rule::Net {
                addr: Ipv4Addr::new(1, 2, 3, 4),
                prefix: 32,
                port: Some(443)
            }
        );
        assert_eq!(
            Rule::parse("*.PythonHosted.org").unwrap(),
            Rule::Domain {
                name: "pythonhosted.org".into(),
                wildcard: true,
                port: None
            }
        );
    }

    #[test]
    fn malformed_rules_name_themselves() {
        for r in [
            "",
            "1.2.3.4:0",
            "1.2.3.4:x",
            "10.0.0.0/33",
            "::1",
            "a..b",
            "300.1.1.1",
            "-a.b",
        ] {
            let e = Rule::parse(r).unwrap_err();
            assert_eq!(e.rule, r);
        }
    }

    #[test]
    fn domains_match_exactly_or_below_a_wildcard() {
        let p = Policy::allow(&["pypi.org", "*.pythonhosted.org:443"]).unwrap();
        assert_eq!(p.domain_ports("pypi.org."), Some(None));
        assert_eq!(p.domain_ports("evil-pypi.org"), None);
        assert_eq!(
            p.domain_ports("files.pythonhosted.org"),
            Some(Some(vec![443]))
        );
        assert_eq!(p.domain_ports("pythonhosted.org"), None);
        assert_eq!(p.domain_ports("xpythonhosted.org"), None);
    }
}
