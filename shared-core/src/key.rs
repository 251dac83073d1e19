//! Identity: the client IP (peer address, `X-Forwarded-For` with trusted hops, IPv6 by
//! prefix) and the composite keys rules count on.

use alloc::borrow::Cow;
use alloc::string::String;
use core::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Parses an address as a host reports it: `1.2.3.4`, `1.2.3.4:80`, `::1`, `[::1]:80`,
/// `[::1]`, with surrounding whitespace. IPv4-mapped IPv6 addresses become IPv4.
///
/// Accepts exactly what `IpAddr`, then `SocketAddr`, then a bracketed `IpAddr` parse from
/// `str` accept (a differential test holds it to that); written by hand because core's
/// address parser was about 4 KB of the filter's wasm.
pub fn parse_ip(raw: &[u8]) -> Option<IpAddr> {
    let s = raw.trim_ascii();
    if s.is_empty() || s.len() > 64 {
        return None;
    }
    let whole = |f: fn(&mut Cursor<'_>) -> Option<IpAddr>| {
        let mut c = Cursor { s, i: 0 };
        f(&mut c).filter(|_| c.i == s.len())
    };
    let ip = whole(|c| c.ipv4().map(IpAddr::V4))
        .or_else(|| whole(|c| c.ipv6().map(IpAddr::V6)))
        .or_else(|| {
            whole(|c| {
                let ip = c.ipv4()?;
                c.port()?;
                Some(IpAddr::V4(ip))
            })
        })
        .or_else(|| {
            whole(|c| {
                c.given(b'[')?;
                let ip = c.ipv6()?;
                if c.given(b'%').is_some() {
                    c.number(10, 10, true).filter(|&v| v <= u64::from(u32::MAX))?;
                }
                c.given(b']')?;
                c.port()?;
                Some(IpAddr::V6(ip))
            })
        })
        .or_else(|| {
            whole(|c| {
                c.given(b'[')?;
                let ip = c.ipv4().map(IpAddr::V4).or_else(|| c.ipv6().map(IpAddr::V6))?;
                c.given(b']')?;
                Some(ip)
            })
        })?;
    Some(match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    })
}

/// A position in an address being parsed; each reader leaves it where it stopped, or
/// unmoved when it fails.
struct Cursor<'a> {
    s: &'a [u8],
    i: usize,
}

impl Cursor<'_> {
    /// Runs `f`, putting the cursor back when it fails.
    fn atomic<T>(&mut self, f: impl FnOnce(&mut Self) -> Option<T>) -> Option<T> {
        let at = self.i;
        let r = f(self);
        if r.is_none() {
            self.i = at;
        }
        r
    }

    fn given(&mut self, b: u8) -> Option<()> {
        let found = self.s.get(self.i) == Some(&b);
        self.i += usize::from(found);
        found.then_some(())
    }

    /// Digits in `radix`, at most `max` of them, with or without a leading zero before more
    /// digits; the value when it fits in a u64.
    fn number(&mut self, radix: u32, max: usize, zero_prefix: bool) -> Option<u64> {
        self.atomic(|c| {
            let start = c.i;
            let mut v: u64 = 0;
            while let Some(d) = c.s.get(c.i).and_then(|&b| char::from(b).to_digit(radix)) {
                if c.i - start == max {
                    break;
                }
                v = v.checked_mul(u64::from(radix))?.checked_add(u64::from(d))?;
                c.i += 1;
            }
            let n = c.i - start;
            let leading_zero = n > 1 && c.s.get(start) == Some(&b'0');
            (n > 0 && (zero_prefix || !leading_zero)).then_some(v)
        })
    }

    fn ipv4(&mut self) -> Option<Ipv4Addr> {
        self.atomic(|c| {
            let mut octets = [0u8; 4];
            for (i, o) in octets.iter_mut().enumerate() {
                if i > 0 {
                    c.given(b'.')?;
                }
                *o = u8::try_from(c.number(10, 3, false)?).ok()?;
            }
            Some(Ipv4Addr::from(octets))
        })
    }

    fn port(&mut self) -> Option<u16> {
        self.atomic(|c| {
            c.given(b':')?;
            u16::try_from(c.number(10, usize::MAX, true)?).ok()
        })
    }

    /// Up to `groups.len()` colon-separated 16-bit groups, the last two of which may be an
    /// embedded IPv4 address; how many were read and whether an IPv4 address ended them.
    fn groups(&mut self, groups: &mut [u16]) -> (usize, bool) {
        let limit = groups.len();
        for i in 0..limit {
            let sep = |c: &mut Self| if i > 0 { c.given(b':') } else { Some(()) };
            if i + 1 < limit {
                if let Some(v4) = self.atomic(|c| sep(c).and_then(|_| c.ipv4())) {
                    let [a, b, x, y] = v4.octets();
                    if let Some(pair) = groups.get_mut(i..i + 2) {
                        pair.copy_from_slice(&[u16::from_be_bytes([a, b]), u16::from_be_bytes([x, y])]);
                    }
                    return (i + 2, true);
                }
            }
            match self.atomic(|c| sep(c).and_then(|_| c.number(16, 4, true))) {
                Some(g) => {
                    if let Some(slot) = groups.get_mut(i) {
                        *slot = g as u16;
                    }
                }
                None => return (i, false),
            }
        }
        (limit, false)
    }

    fn ipv6(&mut self) -> Option<Ipv6Addr> {
        self.atomic(|c| {
            let mut head = [0u16; 8];
            let (head_n, head_v4) = c.groups(&mut head);
            if head_n == 8 {
                return Some(Ipv6Addr::from(head));
            }
            if head_v4 {
                return None;
            }
            c.given(b':')?;
            c.given(b':')?;
            // `::` stands for at least one zero group.
            let mut tail = [0u16; 7];
            let (tail_n, _) = c.groups(tail.get_mut(..7 - head_n)?);
            let (at, from) = (8 - tail_n, tail.get(..tail_n)?);
            head.get_mut(at..)?.copy_from_slice(from);
            Some(Ipv6Addr::from(head))
        })
    }
}

/// How the client IP dimension is derived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpSource {
    /// Proxies in front of this one whose `X-Forwarded-For` entries are trusted. 0 ignores
    /// `X-Forwarded-For` and keys on the peer address.
    pub trusted_hops: u8,
    /// IPv6 clients are keyed by this prefix length (default 64).
    pub ipv6_prefix: u8,
    /// IPv4 clients are keyed by this prefix length (default 32).
    pub ipv4_prefix: u8,
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
            return crate::text::text(e).map(Cow::Borrowed);
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
        let value = octet.iter().try_fold(0u32, |v, &b| {
            if b.is_ascii_digit() {
                v.checked_mul(10)?.checked_add(u32::from(b - b'0'))
            } else {
                None
            }
        });
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
        crate::text::push_decimal(&mut out, u64::from(p));
    }
    out
}

/// `a` in dotted decimal.
fn push_ipv4(out: &mut String, a: Ipv4Addr) {
    for (i, octet) in a.octets().iter().enumerate() {
        if i > 0 {
            out.push('.');
        }
        crate::text::push_decimal(out, u64::from(*octet));
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

pub use crate::hash::{fnv1a, HashKey};

/// How a hashed identity value is shown: `#` and the hash's top 32 bits in 8 lower-case hex
/// digits (`#3f9a1c2e`).
pub fn push_hashed(out: &mut String, hash: u64) {
    out.push('#');
    for i in (0..8).rev() {
        let d = ((hash >> 32) >> (4 * i)) & 15;
        out.push(char::from(b"0123456789abcdef".get(d as usize).copied().unwrap_or(b'0')));
    }
}

/// How a (non-secret) identity value is shown: printable ASCII but the space as is, every
/// other byte and `%`, `,`, `=` as `%XX`, so a shown key is one word and splits back into its
/// pairs.
pub fn push_value(out: &mut String, value: &[u8]) {
    for &b in value {
        if (0x21..0x7f).contains(&b) && !b"%,=".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push('%');
            for d in [b >> 4, b & 15] {
                out.push(char::from(b"0123456789ABCDEF".get(usize::from(d)).copied().unwrap_or(b'0')));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::format;

    #[test]
    fn a_long_run_of_digits_is_no_address_and_no_overflow() {
        for raw in ["12345678901", "99999999999999999999.1.1.1", "1.1.1.4294967296"] {
            assert!(!is_canonical_ipv4(raw.as_bytes()), "{raw}");
            let src = IpSource { trusted_hops: 1, ipv6_prefix: 64, ipv4_prefix: 32 };
            assert_eq!(client_key(|| None, Some(raw.as_bytes()), &src), None, "{raw}");
        }
    }

    /// What `parse_ip` was: core's parsers.
    fn std_parse(raw: &[u8]) -> Option<IpAddr> {
        let s = core::str::from_utf8(raw).ok()?.trim();
        if s.is_empty() || s.len() > 64 {
            return None;
        }
        let ip = s
            .parse::<IpAddr>()
            .ok()
            .or_else(|| s.parse::<core::net::SocketAddr>().ok().map(|a| a.ip()))
            .or_else(|| s.strip_prefix('[').and_then(|r| r.strip_suffix(']')).and_then(|r| r.parse().ok()))?;
        Some(match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 20_000, ..Default::default() })]
        /// Address-shaped text: the hand-written parser accepts exactly what core's did.
        #[test]
        fn parse_ip_agrees_with_cores_parsers(s in "[ \\[\\]%:.0-9a-fA-F]{0,48}") {
            proptest::prop_assert_eq!(parse_ip(s.as_bytes()), std_parse(s.as_bytes()), "{:?}", s);
        }

        #[test]
        fn parse_ip_agrees_on_real_addresses(a in proptest::prelude::any::<u128>(), v4 in proptest::prelude::any::<u32>(),
                                             port in proptest::prelude::any::<u16>(), zeros in 0u32..8, form in 0u8..6) {
            let v6 = Ipv6Addr::from(a & !(u128::MAX.checked_shr(zeros * 16).unwrap_or(0) & (u128::MAX << 64)));
            let v4 = Ipv4Addr::from(v4);
            let text = match form {
                0 => format!("{v6}"),
                1 => format!("[{v6}]:{port}"),
                2 => format!("{v4}:{port}"),
                3 => format!("::ffff:{v4}"),
                4 => format!("[{v6}]"),
                _ => format!(" {v4} "),
            };
            proptest::prop_assert_eq!(parse_ip(text.as_bytes()), std_parse(text.as_bytes()), "{}", text);
            proptest::prop_assert!(parse_ip(text.as_bytes()).is_some(), "{}", text);
        }
    }

    #[test]
    fn parse_ip_edge_cases_match_core() {
        for s in [
            "1.2.3.4",
            "01.2.3.4",
            "1.2.3.256",
            "1.2.3",
            "1.2.3.4.5",
            "::",
            "::1",
            "1::",
            "1:2:3:4:5:6:7:8",
            "1:2:3:4:5:6:7::",
            "::2:3:4:5:6:7:8",
            "1:2:3:4:5:6:7:8:9",
            "1::2::3",
            "::ffff:1.2.3.4",
            "1:2:3:4:5:6:1.2.3.4",
            "1:2:3:4:5:6:7:1.2.3.4",
            "1.2.3.4::",
            "[::1]:80",
            "[::1%3]:80",
            "[::1]",
            "[1.2.3.4]",
            "1.2.3.4:65535",
            "1.2.3.4:65536",
            "1.2.3.4:080",
            "12345::",
            "0:0:0:0:0:0:0:0",
            "fe80::1%eth0",
            " 10.0.0.1 ",
            "[::1]:",
            "1.2.3.4:",
            "::1:",
            ":::",
            "[::1%99999999999]:1",
        ] {
            assert_eq!(parse_ip(s.as_bytes()), std_parse(s.as_bytes()), "{s}");
        }
    }

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
