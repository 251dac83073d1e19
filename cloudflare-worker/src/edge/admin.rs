//! The Worker's admin routes without the runtime: who may read them, and the dashboard page.
//!
//! `GET /_ratewall/top`, `GET /_ratewall/series` and the page at `GET /_ratewall/` answer only
//! a request that presents the `RATEWALL_ADMIN_TOKEN` secret: 401 without it or with another,
//! 404 when the Worker has none (the routes are off). Any non-empty token turns them on; one
//! shorter than [`MIN_TOKEN`] is only warned about. The JSON routes take it only as
//! `Authorization: Bearer …`; the page also as a `token` query parameter, since a browser
//! cannot send a header when it opens an address — the page then takes the token out of its
//! address bar and sends it as a Bearer header with each of its requests.

/// The dashboard page, compiled in.
pub const PAGE: &str = include_str!("../../../dashboard/index.html");

/// Shortest admin token not warned about: a shorter one still opens the routes (to whoever
/// presents it), and the Worker logs once that it is short (never the token).
pub const MIN_TOKEN: usize = 16;

/// The page's response headers: no caching, no referrer, and a policy that lets it reach
/// nothing but the Worker that served it.
pub const PAGE_HEADERS: [(&str, &str); 6] = [
    ("content-type", "text/html; charset=utf-8"),
    ("cache-control", "no-store"),
    ("referrer-policy", "no-referrer"),
    ("x-content-type-options", "nosniff"),
    (
        "content-security-policy",
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; \
         connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    ("x-frame-options", "DENY"),
];

/// What a request to an admin route may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// The token matches.
    Granted,
    /// No token presented, or another one: 401.
    Refused,
    /// The Worker has no admin token (none, or only blanks): 404.
    Off,
}

impl Access {
    /// The HTTP status of a request not [`Access::Granted`].
    pub fn status(self) -> u16 {
        match self {
            Access::Granted => 200,
            Access::Refused => 401,
            Access::Off => 404,
        }
    }
}

/// Whether the two byte strings are equal, in a time that depends only on `expected`'s
/// length (not on where they first differ).
pub fn same_secret(presented: &[u8], expected: &[u8]) -> bool {
    let mut diff = u8::from(presented.len() != expected.len());
    for (i, e) in expected.iter().enumerate() {
        diff |= presented.get(i).copied().unwrap_or(0) ^ e;
    }
    std::hint::black_box(diff) == 0
}

/// The token of an `Authorization: Bearer …` header value.
pub fn bearer(authorization: &str) -> Option<&str> {
    let v = authorization.trim();
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|t| !t.is_empty())
}

/// The access of a request that presents `authorization` (the header's value) and, for the
/// page only, `query_token`, to a Worker whose admin token is `configured`.
pub fn access(configured: Option<&str>, authorization: Option<&str>, query_token: Option<&str>) -> Access {
    let Some(expected) = configured.map(str::trim).filter(|t| !t.is_empty()) else {
        return Access::Off;
    };
    // With an `Authorization` header, it alone decides (whatever its scheme).
    let presented = match authorization {
        Some(a) => bearer(a),
        None => query_token.filter(|t| !t.is_empty()),
    };
    match presented {
        Some(p) if same_secret(p.as_bytes(), expected.as_bytes()) => Access::Granted,
        _ => Access::Refused,
    }
}

/// Why a request was not served (never the token).
pub fn refusal(access: Access, page: bool) -> &'static str {
    match (access, page) {
        (Access::Off, _) => "not found\n",
        (_, true) => "this page needs the admin token: open /_ratewall/?token=YOUR_TOKEN, or send Authorization: Bearer YOUR_TOKEN (RATEWALL_ADMIN_TOKEN)\n",
        _ => "missing or wrong Authorization: Bearer token (RATEWALL_ADMIN_TOKEN)\n",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "an-admin-token-of-some-length";

    #[test]
    fn only_the_configured_token_opens_the_routes() {
        let ok = format!("Bearer {TOKEN}");
        assert_eq!(access(Some(TOKEN), Some(&ok), None), Access::Granted);
        assert_eq!(access(Some(TOKEN), Some(&format!("bearer   {TOKEN} ")), None), Access::Granted);
        assert_eq!(access(Some(TOKEN), None, Some(TOKEN)), Access::Granted, "the page's query parameter");
        assert_eq!(access(Some(TOKEN), None, None), Access::Refused);
        assert_eq!(access(Some(TOKEN), Some("Bearer "), None), Access::Refused);
        assert_eq!(access(Some(TOKEN), Some(&format!("Basic {TOKEN}")), None), Access::Refused);
        assert_eq!(access(Some(TOKEN), Some(&format!("Bearer {TOKEN}x")), None), Access::Refused);
        assert_eq!(access(Some(TOKEN), Some(&ok[..ok.len() - 1]), None), Access::Refused);
        assert_eq!(access(Some(TOKEN), None, Some("")), Access::Refused);
        assert_eq!(access(Some(TOKEN), Some("Bearer wrong"), Some(TOKEN)), Access::Refused, "the header decides");
        assert_eq!(access(Some(TOKEN), Some("Basic d3Jvbmc="), Some(TOKEN)), Access::Refused, "whatever its scheme");
        assert_eq!(access(None, Some(&ok), None), Access::Off);
        assert_eq!(access(Some(""), Some("Bearer "), None), Access::Off);
        assert_eq!(access(Some("  "), Some("Bearer x"), None), Access::Off, "only blanks");
        // A short token is warned about, never a reason to turn the routes off.
        assert_eq!(access(Some("short"), Some("Bearer short"), None), Access::Granted);
        assert_eq!(access(Some("short"), Some("Bearer shorter"), None), Access::Refused);
        assert_eq!(access(Some("short"), None, None), Access::Refused);
        assert_eq!((Access::Refused.status(), Access::Off.status()), (401, 404));
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abd", b"abc"));
        assert!(!same_secret(b"ab", b"abc"));
        assert!(!same_secret(b"abcd", b"abc"));
        assert!(!same_secret(b"", b"abc"));
        assert!(same_secret(b"", b""));
    }

    #[test]
    fn refusals_never_name_the_token() {
        for a in [Access::Refused, Access::Off] {
            for page in [true, false] {
                assert!(!refusal(a, page).contains(TOKEN));
            }
        }
        assert!(refusal(Access::Refused, true).contains("?token="));
    }

    #[test]
    fn the_page_is_the_dashboard_and_reaches_only_its_worker() {
        assert!(PAGE.contains("<title>ratewall</title>"));
        let csp = PAGE_HEADERS.iter().find(|(n, _)| *n == "content-security-policy").map(|(_, v)| *v);
        assert!(csp.is_some_and(|c| c.contains("default-src 'none'") && c.contains("connect-src 'self'")));
    }
}
