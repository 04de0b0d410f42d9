//! The few rtnetlink requests dsec needs, spoken in-process: spawning `ip` several times
//! per sandbox would cost more than the rest of a sandbox's creation.

use std::ffi::CString;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use rustix::net::netlink::{self, SocketAddrNetlink};
use rustix::net::{AddressFamily, Protocol, RecvFlags, SendFlags, SocketFlags, SocketType};

const IFLA_IFNAME: u16 = 3;
const IFLA_MASTER: u16 = 10;
const IFLA_LINKINFO: u16 = 18;
const IFLA_NET_NS_FD: u16 = 28;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const VETH_INFO_PEER: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const IFINFOMSG_LEN: usize = 16;
const NLM_F_REQUEST: u16 = wire16(libc::NLM_F_REQUEST);
const NLM_F_ACK: u16 = wire16(libc::NLM_F_ACK);
const NLM_F_DUMP: u16 = wire16(libc::NLM_F_DUMP);
const NLM_F_CREATE_EXCL: u16 = wire16(libc::NLM_F_CREATE | libc::NLM_F_EXCL);
const NLMSG_ERROR: u16 = wire16(libc::NLMSG_ERROR);
const NLMSG_DONE: u16 = wire16(libc::NLMSG_DONE);
const AF_INET: u8 = 2;
const _: () = assert!(AF_INET as libc::c_int == libc::AF_INET);

/// A constant libc declares as `c_int`, as the 16-bit field of the wire format; checked
/// at compile time.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // asserted in range
const fn wire16(v: libc::c_int) -> u16 {
    assert!(v >= 0 && v <= 0xffff);
    v as u16
}

/// A length in a 16-bit netlink field. dsec's requests hold a few names, addresses and
/// numbers: far under 64 KiB.
#[allow(clippy::cast_possible_truncation)] // bounded as said; checked in debug builds
fn len16(n: usize) -> u16 {
    debug_assert!(n <= usize::from(u16::MAX));
    n as u16
}

/// A NETLINK_ROUTE socket, in the network namespace of the thread that opened it.
pub(crate) struct Rtnl {
    fd: OwnedFd,
    seq: u32,
}

/// One request under construction: header, fixed part, attributes (nests by offset).
struct Msg {
    buf: Vec<u8>,
}

impl Msg {
    fn new(kind: u16, flags: u16) -> Msg {
        let mut buf = vec![0u8; 16];
        buf[4..6].copy_from_slice(&kind.to_ne_bytes());
        let flags = flags | NLM_F_REQUEST | NLM_F_ACK;
        buf[6..8].copy_from_slice(&flags.to_ne_bytes());
        Msg { buf }
    }

    fn raw(&mut self, bytes: &[u8]) -> &mut Msg {
        self.buf.extend_from_slice(bytes);
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
        self
    }

    /// `struct ifinfomsg` with `IFF_UP` set (and changed) when `up`.
    fn ifinfo(&mut self, index: i32, up: bool) -> &mut Msg {
        let mut b = [0u8; IFINFOMSG_LEN];
        b[4..8].copy_from_slice(&index.to_ne_bytes());
        if up {
            let f = (libc::IFF_UP as u32).to_ne_bytes();
            b[8..12].copy_from_slice(&f);
            b[12..16].copy_from_slice(&f);
        }
        self.raw(&b)
    }

    fn attr(&mut self, kind: u16, data: &[u8]) -> &mut Msg {
        let len = len16(4 + data.len());
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.raw(data)
    }

    fn attr_str(&mut self, kind: u16, s: &str) -> &mut Msg {
        let c = CString::new(s).expect("no NUL in interface names");
        self.attr(kind, c.as_bytes_with_nul())
    }

    fn begin(&mut self, kind: u16) -> usize {
        let at = self.buf.len();
        self.attr(kind, &[]);
        at
    }

    fn end(&mut self, at: usize) {
        let len = len16(self.buf.len() - at);
        self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    }
}

/// The index of interface `name` in the calling thread's network namespace.
pub(crate) fn index(name: &str) -> io::Result<i32> {
    if name.contains('\0') {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // What if_nametoindex(3) does: SIOCGIFINDEX on a throw-away socket of this namespace.
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let i = rustix::net::netdevice::name_to_index(&sock, name)?;
    i32::try_from(i).map_err(|_| io::Error::other(format!("interface index {i} out of range")))
}

impl Rtnl {
    /// Opens a socket in the calling thread's network namespace.
    pub(crate) fn open() -> io::Result<Rtnl> {
        // NETLINK_ROUTE is protocol 0, the default.
        Self::open_protocol(None)
    }

    fn open_protocol(protocol: Option<Protocol>) -> io::Result<Rtnl> {
        let fd = rustix::net::socket_with(
            AddressFamily::NETLINK,
            SocketType::RAW,
            SocketFlags::CLOEXEC,
            protocol,
        )?;
        Ok(Rtnl { fd, seq: 0 })
    }

    /// Sends one request and waits for its acknowledgement.
    fn call(&mut self, msg: &mut Msg) -> io::Result<()> {
        self.send(msg)?;
        self.receive(|_, _| {})
    }

    /// Stamps `msg` with the next sequence number and sends it to the kernel.
    fn send(&mut self, msg: &mut Msg) -> io::Result<()> {
        self.seq = self.seq.wrapping_add(1);
        let len = u32::try_from(msg.buf.len()).map_err(io::Error::other)?;
        msg.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        msg.buf[8..12].copy_from_slice(&self.seq.to_ne_bytes());
        // Port 0 is the kernel; no multicast groups.
        let kernel = SocketAddrNetlink::new(0, 0);
        rustix::net::sendto(&self.fd, &msg.buf, SendFlags::empty(), &kernel)?;
        Ok(())
    }

    /// Reads replies to the last request until its acknowledgement (or, for a dump, its
    /// end), handing every other message of that request to `each` as (type, payload).
    fn receive(&mut self, mut each: impl FnMut(u16, &[u8])) -> io::Result<()> {
        let mut reply = vec![0u8; 32 * 1024];
        loop {
            let (n, _) = rustix::net::recv(&self.fd, &mut reply[..], RecvFlags::empty())?;
            let mut off = 0usize;
            while off + 16 <= n {
                let mlen =
                    u32::from_ne_bytes(reply[off..off + 4].try_into().expect("4 bytes")) as usize;
                let kind = u16::from_ne_bytes(reply[off + 4..off + 6].try_into().expect("2"));
                let seq = u32::from_ne_bytes(reply[off + 8..off + 12].try_into().expect("4"));
                if mlen < 16 || off + mlen > n {
                    break;
                }
                if seq == self.seq {
                    if kind == NLMSG_ERROR && mlen >= 20 {
                        let err =
                            i32::from_ne_bytes(reply[off + 16..off + 20].try_into().expect("4"));
                        return if err == 0 {
                            Ok(())
                        } else {
                            Err(io::Error::from_raw_os_error(-err))
                        };
                    }
                    if kind == NLMSG_DONE {
                        return Ok(());
                    }
                    each(kind, &reply[off + 16..off + mlen]);
                }
                off += (mlen + 3) & !3;
            }
        }
    }

    /// The names of every interface in this socket's network namespace. (Not from
    /// `/sys/class/net`: that shows the namespace sysfs was mounted in, which is not this
    /// one for a server started with `nsenter --net`.)
    pub(crate) fn link_names(&mut self) -> io::Result<Vec<String>> {
        let mut m = Msg::new(libc::RTM_GETLINK, NLM_F_DUMP);
        m.ifinfo(0, false);
        self.send(&mut m)?;
        let mut names = Vec::new();
        self.receive(|kind, msg| {
            if kind != libc::RTM_NEWLINK {
                return;
            }
            let name = attrs(msg.get(IFINFOMSG_LEN..).unwrap_or_default())
                .find(|(kind, _)| *kind == IFLA_IFNAME)
                .map(|(_, data)| {
                    String::from_utf8_lossy(data)
                        .trim_end_matches('\0')
                        .to_owned()
                });
            names.extend(name);
        })?;
        Ok(names)
    }

    /// Creates bridge `name` (up).
    pub(crate) fn add_bridge(&mut self, name: &str) -> io::Result<()> {
        let mut m = Msg::new(libc::RTM_NEWLINK, NLM_F_CREATE_EXCL);
        m.ifinfo(0, true).attr_str(IFLA_IFNAME, name);
        let info = m.begin(IFLA_LINKINFO);
        m.attr_str(IFLA_INFO_KIND, "bridge");
        m.end(info);
        self.call(&mut m)
    }

    /// Creates a veth pair: `host` (up, enslaved to bridge `master`) here, `peer` (down)
    /// in the network namespace `netns`.
    pub(crate) fn add_veth(
        &mut self,
        host: &str,
        master: i32,
        peer: &str,
        netns: &OwnedFd,
    ) -> io::Result<()> {
        let mut m = Msg::new(libc::RTM_NEWLINK, NLM_F_CREATE_EXCL);
        m.ifinfo(0, false)
            .attr_str(IFLA_IFNAME, host)
            .attr(IFLA_MASTER, &master.to_ne_bytes());
        let info = m.begin(IFLA_LINKINFO);
        m.attr_str(IFLA_INFO_KIND, "veth");
        let data = m.begin(IFLA_INFO_DATA);
        let p = m.begin(VETH_INFO_PEER);
        m.ifinfo(0, false)
            .attr_str(IFLA_IFNAME, peer)
            .attr(IFLA_NET_NS_FD, &netns.as_raw_fd().to_ne_bytes());
        m.end(p);
        m.end(data);
        m.end(info);
        // Both ends come up afterwards: asking for IFF_UP here fails (ENOTCONN) on kernels
        // that bring an end up before its peer is linked to it.
        self.call(&mut m)?;
        self.set_up(index(host)?)
    }

    /// Sets interface `index` up.
    pub(crate) fn set_up(&mut self, index: i32) -> io::Result<()> {
        let mut m = Msg::new(libc::RTM_NEWLINK, 0);
        m.ifinfo(index, true);
        self.call(&mut m)
    }

    /// Deletes interface `index` (a veth takes its peer with it).
    pub(crate) fn delete(&mut self, index: i32) -> io::Result<()> {
        let mut m = Msg::new(libc::RTM_DELLINK, 0);
        m.ifinfo(index, false);
        self.call(&mut m)
    }

    /// Adds `addr/prefix` to interface `index`.
    pub(crate) fn add_addr(&mut self, index: i32, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
        let mut m = Msg::new(libc::RTM_NEWADDR, NLM_F_CREATE_EXCL);
        let mut ifa = [0u8; 8];
        ifa[0] = AF_INET;
        ifa[1] = prefix;
        ifa[4..8].copy_from_slice(&index.to_ne_bytes());
        m.raw(&ifa)
            .attr(IFA_LOCAL, &addr.octets())
            .attr(IFA_ADDRESS, &addr.octets());
        self.call(&mut m)
    }

    /// Adds a default route via `gateway` on interface `index`.
    pub(crate) fn add_default_route(&mut self, index: i32, gateway: Ipv4Addr) -> io::Result<()> {
        let mut m = Msg::new(libc::RTM_NEWROUTE, NLM_F_CREATE_EXCL);
        let rtm = [
            AF_INET,
            0, // dst_len
            0, // src_len
            0, // tos
            libc::RT_TABLE_MAIN,
            libc::RTPROT_BOOT,
            libc::RT_SCOPE_UNIVERSE,
            libc::RTN_UNICAST,
            0,
            0,
            0,
            0, // flags
        ];
        m.raw(&rtm)
            .attr(RTA_GATEWAY, &gateway.octets())
            .attr(RTA_OIF, &index.to_ne_bytes());
        self.call(&mut m)
    }
}

/// The attributes of a netlink message's payload, as (type without flags, data).
fn attrs(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        let len = usize::from(u16::from_ne_bytes([*buf.first()?, *buf.get(1)?]));
        let kind = u16::from_ne_bytes([*buf.get(2)?, *buf.get(3)?]) & 0x3fff;
        let data = buf.get(4..len)?;
        buf = buf.get((len + 3) & !3..).unwrap_or_default();
        Some((kind, data))
    })
}

/// Runs `f` on a fresh thread that has joined the network namespace `netns`, so that
/// sockets it opens (a [`Rtnl`] included) live there; the thread then ends, and no
/// other thread ever changes namespace.
pub(crate) fn in_netns<T: Send>(
    netns: &OwnedFd,
    f: impl FnOnce() -> io::Result<T> + Send,
) -> io::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            // setns affects only this thread, which exits right after `f`.
            rustix::thread::move_into_link_name_space(
                netns.as_fd(),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )?;
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("netns thread panicked")))
    })
}

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWOBJ: u16 = 18;
const NFT_MSG_GETOBJ: u16 = 19;
const NFTA_OBJ_TABLE: u16 = 1;
const NFTA_OBJ_NAME: u16 = 2;
const NFTA_OBJ_TYPE: u16 = 3;
const NFTA_OBJ_DATA: u16 = 4;
const NFT_OBJECT_COUNTER: u32 = 1;
const NFTA_COUNTER_PACKETS: u16 = 2;
const NFPROTO_INET: u8 = 1;

/// The packet counts of the named counters of nftables table `inet <table>`, by name.
///
/// Read over netlink: `nft list counters` fetches the whole ruleset first, whose size
/// grows with every networked sandbox's chain and sets, and the server reads these at
/// every metrics scrape.
pub(crate) fn named_counters(table: &str) -> io::Result<Vec<(String, u64)>> {
    let mut sock = Rtnl::open_protocol(Some(netlink::NETFILTER))?;
    let mut m = Msg::new((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETOBJ, NLM_F_DUMP);
    // struct nfgenmsg: family, version 0, resource id 0.
    m.raw(&[NFPROTO_INET, 0, 0, 0])
        .attr_str(NFTA_OBJ_TABLE, table)
        .attr(NFTA_OBJ_TYPE, &NFT_OBJECT_COUNTER.to_be_bytes());
    sock.send(&mut m)?;
    let mut counters = Vec::new();
    sock.receive(|kind, msg| {
        if kind != (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWOBJ {
            return;
        }
        let (mut name, mut packets) = (None, None);
        for (kind, data) in attrs(msg.get(4..).unwrap_or_default()) {
            match kind {
                NFTA_OBJ_NAME => {
                    name = Some(
                        String::from_utf8_lossy(data)
                            .trim_end_matches('\0')
                            .to_owned(),
                    );
                }
                NFTA_OBJ_DATA => {
                    packets = attrs(data)
                        .find(|(kind, _)| *kind == NFTA_COUNTER_PACKETS)
                        .and_then(|(_, v)| v.try_into().ok())
                        .map(u64::from_be_bytes);
                }
                _ => {}
            }
        }
        if let (Some(name), Some(packets)) = (name, packets) {
            counters.push((name, packets));
        }
    })?;
    Ok(counters)
}

const NFNL_SUBSYS_ULOG: u16 = 4;
const NFULNL_MSG_PACKET: u16 = 0;
const NFULNL_MSG_CONFIG: u16 = 1;
const NFULA_CFG_CMD: u16 = 1;
const NFULA_CFG_MODE: u16 = 2;
const NFULA_CFG_TIMEOUT: u16 = 4;
const NFULNL_CFG_CMD_BIND: u8 = 1;
const NFULNL_COPY_PACKET: u8 = 2;
const NFULA_PAYLOAD: u16 = 9;
const NFULA_PREFIX: u16 = 10;

/// How long the kernel may hold logged packets before sending them, in 1/100 s.
const FLUSH_HUNDREDTHS: u32 = 5;

/// A packet an nftables `log group` rule sent: its prefix and its first bytes.
pub(crate) struct Logged {
    pub prefix: String,
    pub payload: Vec<u8>,
}

/// A NETLINK_NETFILTER socket bound to one nflog group.
pub(crate) struct NfLog {
    sock: Rtnl,
}

impl NfLog {
    /// Binds nflog group `group`, copying `range` bytes of each packet; receives time out
    /// after `timeout`, so the reader can notice it should stop.
    pub(crate) fn bind(group: u16, range: u32, timeout: std::time::Duration) -> io::Result<NfLog> {
        let mut sock = Rtnl::open_protocol(Some(netlink::NETFILTER))?;
        let kind = (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG;
        let mut genmsg = [0u8; 4];
        genmsg[2..4].copy_from_slice(&group.to_be_bytes());
        let mut m = Msg::new(kind, 0);
        m.raw(&genmsg).attr(NFULA_CFG_CMD, &[NFULNL_CFG_CMD_BIND]);
        sock.call(&mut m)?;
        let mut mode = range.to_be_bytes().to_vec();
        mode.extend_from_slice(&[NFULNL_COPY_PACKET, 0]);
        // The kernel batches logged packets for up to a second by default; a refusal
        // should be an event a caller sees right after it.
        let mut m = Msg::new(kind, 0);
        m.raw(&genmsg)
            .attr(NFULA_CFG_MODE, &mode)
            .attr(NFULA_CFG_TIMEOUT, &FLUSH_HUNDREDTHS.to_be_bytes());
        sock.call(&mut m)?;
        rustix::net::sockopt::set_socket_timeout(
            &sock.fd,
            rustix::net::sockopt::Timeout::Recv,
            Some(timeout),
        )?;
        Ok(NfLog { sock })
    }

    /// The packets of the next datagram (empty after a timeout or a dropped burst).
    pub(crate) fn recv(&self) -> Vec<Logged> {
        let mut buf = [0u8; 16384];
        match rustix::net::recv(&self.sock.fd, &mut buf[..], RecvFlags::empty()) {
            Ok((n, _)) if n > 0 => parse_nflog(&buf[..n]),
            _ => Vec::new(),
        }
    }
}

/// The nflog packet messages of one netlink datagram.
pub(crate) fn parse_nflog(buf: &[u8]) -> Vec<Logged> {
    let u16_at = |b: &[u8], i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
    let mut out = Vec::new();
    let mut off = 0;
    while off + 16 <= buf.len() {
        let mlen = u32::from_ne_bytes(buf[off..off + 4].try_into().expect("4 bytes")) as usize;
        if mlen < 16 || off + mlen > buf.len() {
            break;
        }
        if u16_at(buf, off + 4) == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET {
            let msg = &buf[off + 16..off + mlen];
            let mut logged = Logged {
                prefix: String::new(),
                payload: Vec::new(),
            };
            let mut i = 4; // struct nfgenmsg
            while i + 4 <= msg.len() {
                let alen = u16_at(msg, i) as usize;
                let kind = u16_at(msg, i + 2) & 0x3fff;
                if alen < 4 || i + alen > msg.len() {
                    break;
                }
                let data = &msg[i + 4..i + alen];
                match kind {
                    NFULA_PREFIX => {
                        logged.prefix = String::from_utf8_lossy(data)
                            .trim_end_matches('\0')
                            .to_owned()
                    }
                    NFULA_PAYLOAD => logged.payload = data.to_vec(),
                    _ => {}
                }
                i += (alen + 3) & !3;
            }
            out.push(logged);
        }
        off += (mlen + 3) & !3;
    }
    out
}
