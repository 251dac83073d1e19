//! Identity: the client IP (peer address, `X-Forwarded-For` with trusted hops, IPv6 by
//! prefix) and the composite keys rules count on.

use crate::rules::IpSource;
use alloc::string::String;
use core::fmt::Write;
use core::net::{IpAddr, Ipv6Addr, SocketAddr};

/// Parses an address as a host reports it: `1.2.3.4`, `1.2.3.4:80`, `::1`, `[::1]:80`,
/// with surrounding whitespace. IPv4-mapped IPv6 addresses become IPv4.
pub fn parse_ip(raw: &[u8]) -> Option<IpAddr> {
    let s = core::str::from_utf8(raw).ok()?.trim();
    if s.is_empty() || s.len() > 64 {
        return None;
    }
    let ip = s
        .parse::<IpAddr>()
        .ok()
        .or_else(|| s.parse::<SocketAddr>().ok().map(|a| a.ip()))
        .or_else(|| s.strip_prefix('[').and_then(|r| r.strip_suffix(']')).and_then(|r| r.parse().ok()))?;
    Some(match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    })
}

/// The client IP: with `trusted_hops = 0` the peer address; with `n` trusted proxies in front,
/// the `n`-th `X-Forwarded-For` entry from the right (the address the outermost trusted proxy
/// saw). Entries a client prepends cannot move that position, so they cannot spoof it. With
/// fewer entries than hops the leftmost is used; an unparsable entry falls back to the peer.
pub fn client_ip(peer: Option<&[u8]>, xff: Option<&[u8]>, src: &IpSource) -> Option<IpAddr> {
    client_ip_with(|| peer.and_then(parse_ip), xff, src)
}

/// [`client_ip`] that asks for the peer address only when it decides (a proxy's peer address
/// is a host call).
pub fn client_ip_with(peer: impl FnOnce() -> Option<IpAddr>, xff: Option<&[u8]>, src: &IpSource) -> Option<IpAddr> {
    let hops = usize::from(src.trusted_hops);
    if hops == 0 {
        return peer();
    }
    let Some(xff) = xff else { return peer() };
    // The hops-th entry from the right, or the leftmost when there are fewer.
    let mut from_right = xff.rsplit(|&b| b == b',');
    let mut chosen = None;
    for _ in 0..hops {
        match from_right.next() {
            Some(e) => chosen = Some(e),
            None => break,
        }
    }
    chosen.and_then(parse_ip).or_else(peer)
}

/// The IP as a key: IPv4 masked to `ipv4_prefix`, IPv6 to `ipv6_prefix`, in CIDR form when
/// masked (`2001:db8:1:2::/64`).
pub fn ip_key(ip: IpAddr, src: &IpSource) -> String {
    let mut out = String::with_capacity(48);
    match ip {
        IpAddr::V4(v4) => {
            let p = u32::from(src.ipv4_prefix.min(32));
            let mask = u32::MAX.checked_shl(32 - p).unwrap_or(0);
            // By hand rather than through `core::fmt`: this runs on every per-IP request.
            for (i, octet) in (u32::from(v4) & mask).to_be_bytes().iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                crate::response::push_decimal(&mut out, u64::from(*octet));
            }
            if p < 32 {
                out.push('/');
                crate::response::push_decimal(&mut out, u64::from(p));
            }
        }
        IpAddr::V6(v6) => {
            let p = u32::from(src.ipv6_prefix.min(128));
            let mask = u128::MAX.checked_shl(128 - p).unwrap_or(0);
            let _ = write!(out, "{}", Ipv6Addr::from(u128::from(v6) & mask));
            if p < 128 {
                let _ = write!(out, "/{p}");
            }
        }
    }
    out
}

/// 64-bit FNV-1a: a stable, dependency-free hash for configuration strings.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: IpSource = IpSource { trusted_hops: 1, ipv6_prefix: 64, ipv4_prefix: 32 };

    #[test]
    fn spoofed_forwarded_entries_do_not_move_the_client() {
        let peer = Some(&b"10.0.0.1:4444"[..]);
        let honest = client_ip(peer, Some(b"203.0.113.7"), &SRC);
        let spoofed = client_ip(peer, Some(b"1.1.1.1, 2.2.2.2, 203.0.113.7"), &SRC);
        assert_eq!(honest, Some("203.0.113.7".parse().unwrap()));
        assert_eq!(spoofed, honest);
        let two = IpSource { trusted_hops: 2, ..SRC };
        assert_eq!(client_ip(peer, Some(b"9.9.9.9, 203.0.113.7, 10.1.1.1"), &two), honest);
    }

    #[test]
    fn no_trusted_hops_ignores_forwarded_for() {
        let src = IpSource { trusted_hops: 0, ..SRC };
        assert_eq!(client_ip(Some(b"[2001:db8::1]:443"), Some(b"1.1.1.1"), &src), Some("2001:db8::1".parse().unwrap()));
    }

    #[test]
    fn malformed_entries_fall_back_to_the_peer() {
        let peer = Some(&b"198.51.100.2:1"[..]);
        for xff in [&b"not-an-ip"[..], b"", b",,,", b"\xff\xfe", b"999.1.1.1"] {
            assert_eq!(client_ip(peer, Some(xff), &SRC), Some("198.51.100.2".parse().unwrap()));
        }
    }

    #[test]
    fn ipv6_clients_share_their_prefix() {
        let a = ip_key("2001:db8:1:2:aaaa::1".parse().unwrap(), &SRC);
        let b = ip_key("2001:db8:1:2:bbbb::9".parse().unwrap(), &SRC);
        assert_eq!(a, "2001:db8:1:2::/64");
        assert_eq!(a, b);
        assert_eq!(ip_key("192.0.2.1".parse().unwrap(), &SRC), "192.0.2.1");
        assert_eq!(ip_key("10.200.0.255".parse().unwrap(), &SRC), "10.200.0.255");
        let v4_24 = IpSource { ipv4_prefix: 24, ..SRC };
        assert_eq!(ip_key("203.0.113.77".parse().unwrap(), &v4_24), "203.0.113.0/24");
        assert_eq!(ip_key("203.0.113.77".parse().unwrap(), &IpSource { ipv4_prefix: 0, ..SRC }), "0.0.0.0/0");
        assert_eq!(parse_ip(b"::ffff:192.0.2.1"), Some("192.0.2.1".parse().unwrap()));
    }
}
