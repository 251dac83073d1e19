//! A minimal HTTP/1.1 client over `std::net` for end-to-end tests and benchmarks: one request
//! per connection (`connection: close`), chunked bodies decoded.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A response.
#[derive(Clone, Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// Header names lower-cased, in order.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Response {
    /// The first value of a header.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = b.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(b.get(..line_end)?).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        b = b.get(line_end + 2..)?;
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..size)?);
        b = b.get(size + 2..)?;
    }
}

/// A connection to `addr` (`host:port`, each of its addresses in turn) within `within`.
pub fn connect_within(addr: &str, within: Duration) -> std::io::Result<TcpStream> {
    use std::net::ToSocketAddrs as _;
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, format!("{addr}: no address"));
    for a in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, within) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Sends one request to `addr` (`host:port`) and reads the whole response, within 30 s.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Response> {
    request_within(addr, (method, path), headers, body, Duration::from_secs(30))
}

/// [`request`], connected, sent and answered within `within` (an error past it), as a
/// proxy's call out with a timeout is: a store that hangs fails the call at its timeout, as
/// one that is down does at once.
pub fn request_within(
    addr: &str,
    (method, path): (&str, &str),
    headers: &[(&str, &str)],
    body: &[u8],
    within: Duration,
) -> std::io::Result<Response> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned());
    let deadline = std::time::Instant::now() + within;
    let left = || {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer within the call's timeout"))
        } else {
            Ok(left)
        }
    };
    let mut s = connect_within(addr, left()?)?;
    s.set_write_timeout(Some(left()?))?;
    // The request's own Host when it names one (a proxy forwarding it), else the address.
    let mut req = format!("{method} {path} HTTP/1.1\r\nconnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("host: {addr}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" || method == "PUT" {
        req.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    s.write_all(&bytes)?;
    // Read only as far as the response goes: some servers (wrangler's proxy) keep the
    // connection open for seconds despite `connection: close`.
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let (split, status, head) = loop {
        let Some(p) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
            s.set_read_timeout(Some(left()?))?;
            let n = s.read(&mut buf)?;
            if n == 0 {
                return Err(bad("connection closed before the end of the headers"));
            }
            raw.extend_from_slice(buf.get(..n).unwrap_or_default());
            continue;
        };
        let head = String::from_utf8_lossy(raw.get(..p).unwrap_or_default()).into_owned();
        let status: u16 = head
            .lines()
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("no status line"))?;
        // An interim answer (100 Continue, 103 Early Hints) comes before the response.
        if (100..200).contains(&status) && status != 101 {
            raw.drain(..p + 4);
            continue;
        }
        break (p, status, head);
    };
    let mut lines = head.lines();
    lines.next();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let mut lengths = headers.iter().filter(|(k, _)| k == "content-length").map(|(_, v)| v.parse::<usize>().ok());
    let length = lengths.next().flatten();
    if lengths.any(|l| l != length) {
        return Err(bad("conflicting content-length fields"));
    }
    let no_body = method == "HEAD" || status == 204 || status == 304;
    let mut rest = raw.get(split + 4..).unwrap_or_default().to_vec();
    // A chunked body is parsed only once it could be whole (it ends with its last chunk's
    // blank line): parsed after every read, a large one took quadratic time.
    let complete = |b: &[u8]| {
        if no_body {
            true
        } else if chunked {
            b.ends_with(b"\r\n\r\n") && dechunk(b).is_some()
        } else {
            length.is_some_and(|l| b.len() >= l)
        }
    };
    while !complete(&rest) {
        s.set_read_timeout(Some(left()?))?;
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        rest.extend_from_slice(buf.get(..n).unwrap_or_default());
    }
    if !no_body && !chunked && length.is_some_and(|l| rest.len() < l) {
        return Err(bad("connection closed before the end of the body"));
    }
    let body = if no_body {
        Vec::new()
    } else if chunked {
        dechunk(&rest).ok_or_else(|| bad("bad chunked body"))?
    } else {
        rest.truncate(length.unwrap_or(rest.len()));
        rest
    };
    Ok(Response { status, headers, body })
}
