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

/// Sends one request to `addr` (`host:port`) and reads the whole response.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<Response> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned());
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n");
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
    let split = loop {
        if let Some(p) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break p;
        }
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Err(bad("connection closed before the end of the headers"));
        }
        raw.extend_from_slice(buf.get(..n).unwrap_or_default());
    };
    let head = String::from_utf8_lossy(raw.get(..split).unwrap_or_default()).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("no status line"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let length = headers.iter().find(|(k, _)| k == "content-length").and_then(|(_, v)| v.parse::<usize>().ok());
    let no_body = method == "HEAD" || status == 204 || status == 304;
    let mut rest = raw.get(split + 4..).unwrap_or_default().to_vec();
    let complete = |b: &[u8]| {
        if no_body {
            true
        } else if chunked {
            dechunk(b).is_some()
        } else {
            length.is_some_and(|l| b.len() >= l)
        }
    };
    while !complete(&rest) {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        rest.extend_from_slice(buf.get(..n).unwrap_or_default());
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
