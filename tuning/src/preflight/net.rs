//! Network checks: the NIC MTU, and a don't-fragment ICMP probe of the path MTU to a peer.

use std::io;
use std::mem;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use super::{Check, Outcome};

/// IPv4 header without options, as the kernel builds it for our probes.
const IP_HEADER_BYTES: usize = 20;
/// ICMP echo header: type, code, checksum, identifier, sequence.
const ICMP_HEADER_BYTES: usize = 8;
/// Largest IPv4 packet.
const IP_PACKET_MAX: usize = 65535;
/// Echo requests sent before giving up.
const PROBE_ATTEMPTS: u16 = 3;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO_REQUEST: u8 = 8;

/// The `mtu <nic>` check from the text of `/sys/class/net/<nic>/mtu`: Pass when the MTU is at
/// least `required`, Fail when below or unreadable.
pub fn mtu(nic: &str, sys_class_net_mtu_text: &str, required: u32) -> Check {
    let name = format!("mtu {nic}");
    match sys_class_net_mtu_text.trim().parse::<u32>() {
        Ok(found) if found >= required => Check::new(
            name,
            Outcome::Pass,
            format!("{found} (required {required})"),
        ),
        Ok(found) => Check::new(
            name,
            Outcome::Fail,
            format!(
                "{found}, below the required {required}: `ip link set dev {nic} mtu {required}` \
                 (and persist it in the network configuration)"
            ),
        ),
        Err(_) => Check::new(
            name,
            Outcome::Fail,
            format!(
                "cannot parse /sys/class/net/{nic}/mtu: {:?}",
                sys_class_net_mtu_text.trim()
            ),
        ),
    }
}

/// The MTU of interface `nic`, from `/sys/class/net/<nic>/mtu`.
pub fn nic_mtu(nic: &str) -> io::Result<u32> {
    let text = std::fs::read_to_string(format!("/sys/class/net/{nic}/mtu"))?;
    text.trim().parse().map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("/sys/class/net/{nic}/mtu holds {:?}", text.trim()),
        )
    })
}

/// [`mtu`] on this host's interface `nic`; Fail naming the error when it cannot be read (no
/// such interface).
pub fn mtu_check(nic: &str, required: u32) -> Check {
    let path = format!("/sys/class/net/{nic}/mtu");
    match std::fs::read_to_string(&path) {
        Ok(text) => mtu(nic, &text, required),
        Err(error) => Check::new(
            format!("mtu {nic}"),
            Outcome::Fail,
            format!("cannot read {path}: {error} (is {nic} the data-plane interface?)"),
        ),
    }
}

/// Sends ICMP echo requests with don't-fragment set whose IP packets are exactly `size` bytes
/// (payload `size - 28`) to `peer`, up to 3 attempts each waiting `timeout` for the reply.
///
/// Pass on an echo reply; Fail when the send is refused with EMSGSIZE (the local MTU, or a
/// path MTU the kernel has learned, is below `size`) or when no reply comes back (an MTU on the
/// path is below `size`, or the peer does not answer pings). Uses an unprivileged ICMP datagram
/// socket, else (when `net.ipv4.ping_group_range` excludes us) a raw socket, which needs root
/// or CAP_NET_RAW; Skip when neither is allowed. IPv4 only: Skip for an IPv6 peer.
pub fn df_probe(peer: IpAddr, size: usize, timeout: Duration) -> Check {
    let name = format!("df probe {peer} {size}");
    let IpAddr::V4(peer) = peer else {
        return Check::new(
            name,
            Outcome::Skip,
            "IPv6 peers are not probed (the don't-fragment probe is IPv4 only)",
        );
    };
    if !(IP_HEADER_BYTES + ICMP_HEADER_BYTES..=IP_PACKET_MAX).contains(&size) {
        return Check::new(
            name,
            Outcome::Fail,
            format!(
                "probe size must be {}..={IP_PACKET_MAX} bytes",
                IP_HEADER_BYTES + ICMP_HEADER_BYTES
            ),
        );
    }
    match probe_v4(peer, size, timeout) {
        Ok(Some((rtt, kind))) => Check::new(
            name,
            Outcome::Pass,
            format!(
                "echo reply to a {size}-byte don't-fragment probe in {:.3} ms ({kind} socket)",
                rtt.as_secs_f64() * 1e3
            ),
        ),
        Ok(None) => Check::new(
            name,
            Outcome::Fail,
            format!(
                "no reply to a {size}-byte don't-fragment probe: an MTU on the path is below \
                 {size} (or {peer} does not answer ICMP echo)"
            ),
        ),
        Err(ProbeError::MsgSize) => Check::new(
            name,
            Outcome::Fail,
            format!(
                "local MTU below {size}: the kernel refuses a {size}-byte don't-fragment packet \
                 to {peer} (interface MTU, or a path MTU learned from ICMP)"
            ),
        ),
        Err(ProbeError::NotPermitted(error)) => Check::new(
            name,
            Outcome::Skip,
            format!(
                "cannot open an ICMP socket ({error}): run as root or widen \
                 net.ipv4.ping_group_range"
            ),
        ),
        Err(ProbeError::Io(error)) => Check::new(
            name,
            Outcome::Fail,
            format!("probe to {peer} failed: {error}"),
        ),
    }
}

enum ProbeError {
    /// EMSGSIZE at send, or reported by an ICMP "fragmentation needed" for our probe.
    MsgSize,
    /// Neither socket kind may be opened.
    NotPermitted(io::Error),
    Io(io::Error),
}

impl From<io::Error> for ProbeError {
    fn from(error: io::Error) -> ProbeError {
        if error.raw_os_error() == Some(libc::EMSGSIZE) {
            ProbeError::MsgSize
        } else {
            ProbeError::Io(error)
        }
    }
}

/// Distinguishes concurrent probes of this process on raw sockets (which see every ICMP
/// packet); datagram sockets get their identifier from the kernel.
static NEXT_ID: AtomicU16 = AtomicU16::new(0);

/// The round-trip time and socket kind of the first echo reply, or None after all attempts.
fn probe_v4(
    peer: Ipv4Addr,
    size: usize,
    timeout: Duration,
) -> Result<Option<(Duration, &'static str)>, ProbeError> {
    let (socket, raw) = open_icmp_socket()?;
    let kind = if raw { "raw" } else { "datagram" };
    let value: libc::c_int = libc::IP_PMTUDISC_DO;
    // SAFETY: `value` is a live c_int and the length passed is its size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            (&value as *const libc::c_int).cast(),
            mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error().into());
    }
    let id = (std::process::id() as u16) ^ NEXT_ID.fetch_add(0x9e37, Ordering::Relaxed);
    // SAFETY: sockaddr_in is plain data; all-zero is a valid value, filled in below.
    let mut addr: libc::sockaddr_in = unsafe { mem::zeroed() };
    addr.sin_family = libc::AF_INET as libc::sa_family_t;
    addr.sin_addr.s_addr = u32::from(peer).to_be();
    let mut packet: Vec<u8> = (0..size - IP_HEADER_BYTES)
        .map(|i| (i % 251) as u8)
        .collect();
    let mut buffer = vec![0u8; IP_PACKET_MAX];
    for seq in 1..=PROBE_ATTEMPTS {
        packet[..ICMP_HEADER_BYTES].copy_from_slice(&[
            ICMP_ECHO_REQUEST,
            0,
            0,
            0,
            (id >> 8) as u8,
            id as u8,
            (seq >> 8) as u8,
            seq as u8,
        ]);
        let sum = checksum(&packet);
        packet[2..4].copy_from_slice(&sum.to_be_bytes());
        let sent_at = Instant::now();
        // SAFETY: `packet` and `addr` are live for the call, lengths are theirs.
        let sent = unsafe {
            libc::sendto(
                socket.as_raw_fd(),
                packet.as_ptr().cast(),
                packet.len(),
                0,
                (&addr as *const libc::sockaddr_in).cast(),
                mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error().into());
        }
        let deadline = sent_at + timeout;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let mut poll = libc::pollfd {
                fd: socket.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let millis = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
            // SAFETY: `poll` is one live pollfd.
            let ready = unsafe { libc::poll(&mut poll, 1, millis) };
            if ready < 0 {
                let error = io::Error::last_os_error();
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(error.into());
            }
            if ready == 0 {
                break;
            }
            // SAFETY: `buffer` is live and writable for its length.
            let got = unsafe {
                libc::recv(
                    socket.as_raw_fd(),
                    buffer.as_mut_ptr().cast(),
                    buffer.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if got < 0 {
                let error = io::Error::last_os_error();
                if matches!(
                    error.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) {
                    continue;
                }
                // EMSGSIZE here: an ICMP "fragmentation needed" came back for our probe.
                return Err(error.into());
            }
            if is_our_reply(&buffer[..got as usize], raw, peer, id, seq) {
                return Ok(Some((sent_at.elapsed(), kind)));
            }
        }
    }
    Ok(None)
}

/// An ICMP datagram socket, else a raw ICMP socket (true).
fn open_icmp_socket() -> Result<(OwnedFd, bool), ProbeError> {
    let open = |kind: libc::c_int| -> io::Result<OwnedFd> {
        // SAFETY: plain socket(2) call; the descriptor is owned below.
        let fd =
            unsafe { libc::socket(libc::AF_INET, kind | libc::SOCK_CLOEXEC, libc::IPPROTO_ICMP) };
        if fd < 0 {
            Err(io::Error::last_os_error())
        } else {
            // SAFETY: `fd` is a fresh descriptor nobody else owns.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        }
    };
    let refused =
        |error: &io::Error| matches!(error.raw_os_error(), Some(libc::EACCES | libc::EPERM));
    match open(libc::SOCK_DGRAM) {
        Ok(fd) => Ok((fd, false)),
        Err(error) if refused(&error) => match open(libc::SOCK_RAW) {
            Ok(fd) => Ok((fd, true)),
            Err(raw_error) if refused(&raw_error) => Err(ProbeError::NotPermitted(raw_error)),
            Err(raw_error) => Err(ProbeError::Io(raw_error)),
        },
        Err(error) => Err(ProbeError::Io(error)),
    }
}

/// Whether `packet` (with its IP header on a raw socket) is the echo reply to (`id`, `seq`)
/// from `peer`. A datagram socket only delivers replies to its own identifier, which the
/// kernel chose, so there only the type and sequence are checked.
fn is_our_reply(packet: &[u8], raw: bool, peer: Ipv4Addr, id: u16, seq: u16) -> bool {
    let icmp = if raw {
        let Some(&first) = packet.first() else {
            return false;
        };
        let header = usize::from(first & 0x0f) * 4;
        if packet.len() < header || header < IP_HEADER_BYTES || packet[12..16] != peer.octets() {
            return false;
        }
        &packet[header..]
    } else {
        packet
    };
    icmp.len() >= ICMP_HEADER_BYTES
        && icmp[0] == ICMP_ECHO_REPLY
        && (!raw || u16::from_be_bytes([icmp[4], icmp[5]]) == id)
        && u16::from_be_bytes([icmp[6], icmp[7]]) == seq
}

/// The Internet checksum (RFC 1071) of `data`, with its checksum field zero.
fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut chunks = data.chunks_exact(2);
    for pair in &mut chunks {
        sum += u32::from(u16::from_be_bytes([pair[0], pair[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_pass_fail_unparsable() {
        assert_eq!(
            mtu("eth0", "3900\n", 3900),
            Check::new("mtu eth0", Outcome::Pass, "3900 (required 3900)")
        );
        let low = mtu("eth0", "1500\n", 3900);
        assert_eq!(low.outcome, Outcome::Fail);
        assert!(
            low.detail.starts_with("1500, below the required 3900"),
            "{}",
            low.detail
        );
        assert_eq!(mtu("eth0", "x", 3900).outcome, Outcome::Fail);
    }

    #[test]
    fn loopback_mtu_reads() {
        if std::path::Path::new("/sys/class/net/lo/mtu").exists() {
            assert!(nic_mtu("lo").unwrap() > 0);
        }
        assert!(nic_mtu("no-such-nic-felix").is_err());
        assert_eq!(mtu_check("no-such-nic-felix", 1500).outcome, Outcome::Fail);
    }

    #[test]
    fn checksum_of_echo_request() {
        // Echo request id 0x1234 seq 1, payload "ab": known-good checksum.
        let mut packet = vec![8, 0, 0, 0, 0x12, 0x34, 0, 1, b'a', b'b'];
        let sum = checksum(&packet);
        packet[2..4].copy_from_slice(&sum.to_be_bytes());
        assert_eq!(checksum(&packet), 0);
        assert_eq!(checksum(&[0xff]), 0x00ff);
    }

    #[test]
    fn reply_matching() {
        let peer = Ipv4Addr::new(10, 0, 0, 2);
        let mut raw = vec![0x45u8; 20];
        raw[12..16].copy_from_slice(&peer.octets());
        raw.extend_from_slice(&[0, 0, 0, 0, 0x12, 0x34, 0, 1]);
        assert!(is_our_reply(&raw, true, peer, 0x1234, 1));
        assert!(!is_our_reply(&raw, true, peer, 0x1235, 1));
        assert!(!is_our_reply(
            &raw,
            true,
            Ipv4Addr::new(10, 0, 0, 3),
            0x1234,
            1
        ));
        assert!(is_our_reply(&raw[20..], false, peer, 0, 1));
        assert!(!is_our_reply(&raw[20..], false, peer, 0, 2));
        assert!(!is_our_reply(&[], true, peer, 0, 1));
    }

    #[test]
    fn ipv6_and_bad_sizes() {
        let v6 = df_probe("::1".parse().unwrap(), 3900, Duration::from_secs(1));
        assert_eq!(v6.outcome, Outcome::Skip);
        let tiny = df_probe("127.0.0.1".parse().unwrap(), 10, Duration::from_secs(1));
        assert_eq!(tiny.outcome, Outcome::Fail);
    }

    #[test]
    fn loopback_probe_runs() {
        // Loopback's MTU is 65536; whether this passes depends on socket permissions.
        let check = df_probe("127.0.0.1".parse().unwrap(), 1500, Duration::from_secs(2));
        eprintln!("{check:?}");
        assert!(
            matches!(check.outcome, Outcome::Pass | Outcome::Skip),
            "{check:?}"
        );
    }
}
