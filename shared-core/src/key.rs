//! Identity: the client IP (peer address, `X-Forwarded-For` with trusted hops, IPv6 by
//! prefix) and the composite keys rules count on.

use crate::rules::IpSource;
use alloc::borrow::Cow;
use alloc::string::String;
use core::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

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
    match xff.and_then(|x| forwarded_entry(x, src.trusted_hops)) {
        Some(entry) => parse_ip(entry).or_else(peer),
        None => peer(),
    }
}

/// The `X-Forwarded-For` entry [`client_ip`] trusts: the `hops`-th from the right, or the
/// leftmost when there are fewer (`None` with no trusted hops).
fn forwarded_entry(xff: &[u8], hops: u8) -> Option<&[u8]> {
    let mut chosen = None;
    for e in xff.rsplit(|&b| b == b',').take(usize::from(hops)) {
        chosen = Some(e);
    }
    chosen
}

/// [`client_ip_with`] then [`ip_key`], borrowed from `xff` when the trusted entry already is
/// its own key: a dotted-quad IPv4 address in canonical form, keyed by /32 (the common case,
/// spared a parse and an allocation on the request path).
pub fn client_key<'a>(
    peer: impl FnOnce() -> Option<IpAddr>,
    xff: Option<&'a [u8]>,
    src: &IpSource,
) -> Option<Cow<'a, str>> {
    let entry = xff.and_then(|x| forwarded_entry(x, src.trusted_hops)).map(<[u8]>::trim_ascii);
    if let (Some(e), true) = (entry, src.ipv4_prefix >= 32) {
        if is_canonical_ipv4(e) {
            return crate::text(e).map(Cow::Borrowed);
        }
    }
    client_ip_with(peer, xff, src).map(|ip| Cow::Owned(ip_key(ip, src)))
}

/// Four decimal octets `0..=255` without leading zeros, dot-separated: exactly the text
/// [`ip_key`] writes for that address at /32.
fn is_canonical_ipv4(s: &[u8]) -> bool {
    let mut parts = 0;
    for octet in s.split(|&b| b == b'.') {
        parts += 1;
        let value = octet.iter().try_fold(0u32, |v, &b| b.is_ascii_digit().then(|| v * 10 + u32::from(b - b'0')));
        let canonical = matches!(octet.len(), 1..=3) && !(octet.len() > 1 && octet.first() == Some(&b'0'));
        if parts > 4 || !canonical || value.is_none_or(|v| v > 255) {
            return false;
        }
    }
    parts == 4
}

/// The IP as a key: IPv4 masked to `ipv4_prefix`, IPv6 to `ipv6_prefix`, in CIDR form when
/// masked (`2001:db8:1:2::/64`).
pub fn ip_key(ip: IpAddr, src: &IpSource) -> String {
    let mut out = String::with_capacity(48);
    // By hand rather than through `core::fmt`: this runs on every per-IP request, and the
    // IPv6 formatter alone is 1.6 KB of wasm.
    let p = match ip {
        IpAddr::V4(v4) => {
            let p = u32::from(src.ipv4_prefix.min(32));
            push_ipv4(&mut out, Ipv4Addr::from(u32::from(v4) & u32::MAX.checked_shl(32 - p).unwrap_or(0)));
            (p < 32).then_some(p)
        }
        IpAddr::V6(v6) => {
            let p = u32::from(src.ipv6_prefix.min(128));
            push_ipv6(&mut out, Ipv6Addr::from(u128::from(v6) & u128::MAX.checked_shl(128 - p).unwrap_or(0)));
            (p < 128).then_some(p)
        }
    };
    if let Some(p) = p {
        out.push('/');
        crate::response::push_decimal(&mut out, u64::from(p));
    }
    out
}

/// `a` in dotted decimal.
fn push_ipv4(out: &mut String, a: Ipv4Addr) {
    for (i, octet) in a.octets().iter().enumerate() {
        if i > 0 {
            out.push('.');
        }
        crate::response::push_decimal(out, u64::from(*octet));
    }
}

/// `a` as `Display` writes it (RFC 5952): lower-case hex groups without leading zeros, the
/// longest run of two or more zero groups (the first of equal ones) as `::`, and an
/// IPv4-mapped address as `::ffff:a.b.c.d`.
fn push_ipv6(out: &mut String, a: Ipv6Addr) {
    if let Some(v4) = a.to_ipv4_mapped() {
        out.push_str("::ffff:");
        push_ipv4(out, v4);
        return;
    }
    let groups = a.segments();
    let (mut run_at, mut run_len, mut at, mut len) = (0, 0, 0, 0);
    for (i, &g) in groups.iter().enumerate() {
        if g != 0 {
            len = 0;
            continue;
        }
        if len == 0 {
            at = i;
        }
        len += 1;
        if len > run_len {
            (run_at, run_len) = (at, len);
        }
    }
    let push_groups = |out: &mut String, gs: &[u16]| {
        for (i, &g) in gs.iter().enumerate() {
            if i > 0 {
                out.push(':');
            }
            let digits = [g >> 12, (g >> 8) & 15, (g >> 4) & 15, g & 15];
            let first = digits.iter().position(|&d| d != 0).unwrap_or(3);
            for &d in digits.get(first..).unwrap_or(&[]) {
                out.push(char::from(b"0123456789abcdef".get(usize::from(d)).copied().unwrap_or(b'0')));
            }
        }
    };
    if run_len > 1 {
        push_groups(out, groups.get(..run_at).unwrap_or(&[]));
        out.push_str("::");
        push_groups(out, groups.get(run_at + run_len..).unwrap_or(&[]));
    } else {
        push_groups(out, &groups);
    }
}

pub use crate::hash::fnv1a;

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::format;

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
    fn client_keys_borrowed_or_built_are_the_same_key() {
        let peer = Some(&b"10.0.0.1:4444"[..]);
        let v4_24 = IpSource { ipv4_prefix: 24, ..SRC };
        let no_hops = IpSource { trusted_hops: 0, ..SRC };
        let xffs: [&[u8]; 14] = [
            b"203.0.113.7",
            b" 203.0.113.7 ",
            b"1.1.1.1, 2.2.2.2, 0.0.0.0",
            b"255.255.255.255",
            b"256.1.1.1",
            b"01.2.3.4",
            b"1.2.3",
            b"1.2.3.4.5",
            b"1..3.4",
            b"1.2.3.4:80",
            b"2001:db8::1",
            b"::ffff:192.0.2.1",
            b"\xff\xfe",
            b"",
        ];
        for xff in xffs {
            for src in [SRC, v4_24, no_hops] {
                let built = client_ip(peer, Some(xff), &src).map(|ip| ip_key(ip, &src));
                let key = client_key(|| peer.and_then(parse_ip), Some(xff), &src);
                assert_eq!(key.as_deref(), built.as_deref(), "{:?} {src:?}", core::str::from_utf8(xff));
            }
        }
        assert!(matches!(client_key(|| None, Some(b"198.51.100.2"), &SRC), Some(Cow::Borrowed("198.51.100.2"))));
        assert!(matches!(client_key(|| None, Some(b"198.51.100.2"), &v4_24), Some(Cow::Owned(_))));
    }

    #[test]
    fn ipv6_keys_are_written_as_display_writes_them() {
        let mut addrs: alloc::vec::Vec<u128> = alloc::vec![0, 1, u128::MAX, 1 << 127, 0xffff_0102_0304, 0x0102_0304];
        for text in
            ["1:0:0:1:0:0:0:1", "1:0:1:0:1:0:1:0", "0:0:1::", "1::", "1:0:0:2:0:0:3:4", "2001:db8::ff00:42:8329"]
        {
            addrs.push(u128::from(text.parse::<Ipv6Addr>().unwrap()));
        }
        // Pseudo-random addresses with zero groups in random places.
        let mut x: u128 = 0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c834;
        for _ in 0..5000 {
            x = x.wrapping_mul(0x2360_ed05_1fc6_5da4_4385_df64_9fcc_f645).wrapping_add(0x5851_f42d_4c95_7f2d);
            let zeros = (x >> 64) as u8;
            let a = (0..8).fold(x, |a, i| if zeros & (1 << i) != 0 { a & !(0xffff << (16 * i)) } else { a });
            addrs.push(a);
        }
        for a in addrs {
            for prefix in [128, 64, 48, 0] {
                let src = IpSource { ipv6_prefix: prefix, ..SRC };
                let masked = Ipv6Addr::from(a & u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0));
                let expected = if prefix < 128 { format!("{masked}/{prefix}") } else { format!("{masked}") };
                assert_eq!(ip_key(IpAddr::V6(Ipv6Addr::from(a)), &src), expected, "{a:#x}");
            }
        }
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
