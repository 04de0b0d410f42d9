//! The few rtnetlink requests dsec needs, spoken in-process: spawning `ip` several times
//! per sandbox would cost more than the rest of a sandbox's creation.

use std::ffi::CString;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

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
        let flags = flags | libc::NLM_F_REQUEST as u16 | libc::NLM_F_ACK as u16;
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
        let len = (4 + data.len()) as u16;
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
        let len = (self.buf.len() - at) as u16;
        self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    }
}

/// The index of interface `name` in the calling thread's network namespace.
pub(crate) fn index(name: &str) -> io::Result<i32> {
    let c = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `c` is a valid NUL-terminated string for the duration of the call.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(i as i32)
}

impl Rtnl {
    /// Opens a socket in the calling thread's network namespace.
    pub(crate) fn open() -> io::Result<Rtnl> {
        Self::open_protocol(libc::NETLINK_ROUTE)
    }

    fn open_protocol(protocol: i32) -> io::Result<Rtnl> {
        // SAFETY: plain socket(2) call; the result is checked before use.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                protocol,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
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
        let len = msg.buf.len() as u32;
        msg.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        msg.buf[8..12].copy_from_slice(&self.seq.to_ne_bytes());
        // SAFETY: an all-zero sockaddr_nl is valid (family set below; pid 0 = the kernel).
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: the buffer and the address outlive the call; lengths are theirs.
        let sent = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                msg.buf.as_ptr().cast(),
                msg.buf.len(),
                0,
                std::ptr::addr_of!(addr).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Reads replies to the last request until its acknowledgement (or, for a dump, its
    /// end), handing every other message of that request to `each` as (type, payload).
    fn receive(&mut self, mut each: impl FnMut(u16, &[u8])) -> io::Result<()> {
        let mut reply = vec![0u8; 32 * 1024];
        loop {
            // SAFETY: `reply` is writable for its whole length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    reply.as_mut_ptr().cast(),
                    reply.len(),
                    0,
                )
            };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            let mut off = 0usize;
            while off + 16 <= n as usize {
                let mlen =
                    u32::from_ne_bytes(reply[off..off + 4].try_into().expect("4 bytes")) as usize;
                let kind = u16::from_ne_bytes(reply[off + 4..off + 6].try_into().expect("2"));
                let seq = u32::from_ne_bytes(reply[off + 8..off + 12].try_into().expect("4"));
                if mlen < 16 || off + mlen > n as usize {
                    break;
                }
                if seq == self.seq {
                    if kind == libc::NLMSG_ERROR as u16 && mlen >= 20 {
                        let err =
                            i32::from_ne_bytes(reply[off + 16..off + 20].try_into().expect("4"));
                        return if err == 0 {
                            Ok(())
                        } else {
                            Err(io::Error::from_raw_os_error(-err))
                        };
                    }
                    if kind == libc::NLMSG_DONE as u16 {
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
        let mut m = Msg::new(libc::RTM_GETLINK, libc::NLM_F_DUMP as u16);
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
        let mut m = Msg::new(
            libc::RTM_NEWLINK,
            (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16,
        );
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
        let mut m = Msg::new(
            libc::RTM_NEWLINK,
            (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16,
        );
        m.ifinfo(0, false)
            .attr_str(IFLA_IFNAME, host)
            .attr(IFLA_MASTER, &(master as u32).to_ne_bytes());
        let info = m.begin(IFLA_LINKINFO);
        m.attr_str(IFLA_INFO_KIND, "veth");
        let data = m.begin(IFLA_INFO_DATA);
        let p = m.begin(VETH_INFO_PEER);
        m.ifinfo(0, false)
            .attr_str(IFLA_IFNAME, peer)
            .attr(IFLA_NET_NS_FD, &(netns.as_raw_fd() as u32).to_ne_bytes());
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
        let mut m = Msg::new(
            libc::RTM_NEWADDR,
            (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16,
        );
        let mut ifa = [0u8; 8];
        ifa[0] = libc::AF_INET as u8;
        ifa[1] = prefix;
        ifa[4..8].copy_from_slice(&(index as u32).to_ne_bytes());
        m.raw(&ifa)
            .attr(IFA_LOCAL, &addr.octets())
            .attr(IFA_ADDRESS, &addr.octets());
        self.call(&mut m)
    }

    /// Adds a default route via `gateway` on interface `index`.
    pub(crate) fn add_default_route(&mut self, index: i32, gateway: Ipv4Addr) -> io::Result<()> {
        let mut m = Msg::new(
            libc::RTM_NEWROUTE,
            (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16,
        );
        let rtm = [
            libc::AF_INET as u8,
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
            .attr(RTA_OIF, &(index as u32).to_ne_bytes());
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
            // SAFETY: `netns` is an open network-namespace descriptor; setns affects only
            // this thread, which exits right after `f`.
            if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("netns thread panicked")))
    })
}

const NFNL_SUBSYS_ULOG: u16 = 4;
const NFULNL_MSG_PACKET: u16 = 0;
const NFULNL_MSG_CONFIG: u16 = 1;
const NFULA_CFG_CMD: u16 = 1;
const NFULA_CFG_MODE: u16 = 2;
const NFULNL_CFG_CMD_BIND: u8 = 1;
const NFULNL_COPY_PACKET: u8 = 2;
const NFULA_PAYLOAD: u16 = 9;
const NFULA_PREFIX: u16 = 10;

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
        let mut sock = Rtnl::open_protocol(libc::NETLINK_NETFILTER)?;
        let kind = (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG;
        let mut genmsg = [0u8; 4];
        genmsg[2..4].copy_from_slice(&group.to_be_bytes());
        let mut m = Msg::new(kind, 0);
        m.raw(&genmsg).attr(NFULA_CFG_CMD, &[NFULNL_CFG_CMD_BIND]);
        sock.call(&mut m)?;
        let mut mode = range.to_be_bytes().to_vec();
        mode.extend_from_slice(&[NFULNL_COPY_PACKET, 0]);
        let mut m = Msg::new(kind, 0);
        m.raw(&genmsg).attr(NFULA_CFG_MODE, &mode);
        sock.call(&mut m)?;
        let tv = libc::timeval {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_usec: timeout.subsec_micros() as libc::suseconds_t,
        };
        // SAFETY: `tv` is a valid timeval that outlives the call; the length is its size.
        let rc = unsafe {
            libc::setsockopt(
                sock.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                std::ptr::addr_of!(tv).cast(),
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(NfLog { sock })
    }

    /// The packets of the next datagram (empty after a timeout or a dropped burst).
    pub(crate) fn recv(&self) -> Vec<Logged> {
        let mut buf = [0u8; 16384];
        // SAFETY: `buf` is writable for its whole length.
        let n = unsafe {
            libc::recv(
                self.sock.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
            )
        };
        if n <= 0 {
            return Vec::new();
        }
        parse_nflog(&buf[..n as usize])
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
