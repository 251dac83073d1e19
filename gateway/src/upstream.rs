//! The gateway's side of an upstream exchange: a request sent to the origin, and its answer
//! passed on to the client as it comes — the status line and header fields read whole (at most
//! [`MAX_HEAD`] bytes), the body read and written a buffer at a time in the framing the origin
//! gave it, so an answer of any size takes a buffer's worth of the gateway's memory.

use crate::{reason, MAX_HEAD};
use ratewall_host::HttpRequest;
use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// How long the upstream has to connect, and then each read from it or write to the client
/// may wait.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(60);

/// Headers that belong to one connection (RFC 9110 7.6.1), not passed across the gateway,
/// with the body's framing, which the gateway sets itself, and `expect` (the gateway has read
/// the body already).
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "expect",
];

/// Whether header `name` is passed across the gateway: not hop by hop, nor named in a
/// `Connection` field (`named`, lower-cased).
fn passed(name: &str, named: &[String]) -> bool {
    !HOP_BY_HOP.contains(&name) && !named.iter().any(|n| n == name)
}

/// The field names a message's `Connection` fields (`values`) name (lower-cased).
fn connection_named(values: impl Iterator<Item = impl AsRef<str>>) -> Vec<String> {
    let mut named = Vec::new();
    for v in values {
        named.extend(v.as_ref().split(',').map(|n| n.trim().to_ascii_lowercase()).filter(|n| !n.is_empty()));
    }
    named
}

/// A request as the upstream is sent it: its header fields (the authority as `host`) and body.
pub struct Outbound {
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Whether the client speaks HTTP/1.0.
    pub http10: bool,
}

impl Outbound {
    pub fn of(req: &HttpRequest, body: Vec<u8>, http10: bool) -> Outbound {
        let text = |v: &[u8]| String::from_utf8_lossy(v).into_owned();
        let named = connection_named(req.headers.iter().filter(|(k, _)| k == "connection").map(|(_, v)| text(v)));
        let headers = req
            .headers
            .iter()
            .filter_map(|(k, v)| match k.as_str() {
                ":authority" => Some(("host".to_owned(), text(v))),
                k if k.starts_with(':') || !passed(k, &named) => None,
                k => Some((k.to_owned(), text(v))),
            })
            .collect();
        Outbound { headers, body, http10 }
    }
}

/// An answer as it is passed on to a client.
pub struct Upstreamed {
    pub status: u16,
    /// The origin's reason phrase (the gateway's own for its answers, and for a phrase that is
    /// not plain text).
    reason: Option<String>,
    /// Header fields, names lower-cased, those of the origin's connection left out.
    pub headers: Vec<(String, String)>,
    body: Payload,
}

/// An answer's body.
enum Payload {
    /// Held whole: the gateway's own answers.
    Whole(Vec<u8>),
    /// Still coming on the origin's connection, framed as it says.
    Coming(BufReader<Timed>, Framing),
}

/// The origin's connection, read until a deadline (its answer's head, interim answers
/// included, has [`UPSTREAM_TIMEOUT`] in all), then with each read waiting at most that long
/// (a body may take as long as it takes while it keeps coming).
/// While a body's next bytes are awaited, the client is looked at this often: one that went
/// away ends the exchange (its `concurrent` slot comes back then, not when a write to it
/// fails after the origin's next bytes).
const WATCH_EVERY: Duration = Duration::from_secs(1);

pub struct Timed {
    stream: TcpStream,
    until: Option<Instant>,
    /// The client the body goes to.
    watch: Option<TcpStream>,
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(until) = self.until {
            let wait = until.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            self.stream.set_read_timeout(Some(wait))?;
            return self.stream.read(buf);
        }
        let mut idle = Duration::ZERO;
        loop {
            self.stream.set_read_timeout(Some(WATCH_EVERY))?;
            match self.stream.read(buf) {
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    idle = idle.saturating_add(WATCH_EVERY);
                    if idle >= UPSTREAM_TIMEOUT {
                        return Err(std::io::ErrorKind::TimedOut.into());
                    }
                    if self.watch.as_ref().is_some_and(left) {
                        return Err(std::io::ErrorKind::ConnectionAborted.into());
                    }
                }
                done => return done,
            }
        }
    }
}

/// Whether a client (its connection in blocking mode, being written to) has closed it: a
/// peek that waits a millisecond finds its end.
fn left(client: &TcpStream) -> bool {
    client.set_read_timeout(Some(Duration::from_millis(1))).is_ok() && crate::gone(client)
}

/// How the end of a body on the origin's connection is told (RFC 9112 6.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framing {
    /// No body (an answer to HEAD, a 204, a 304).
    None,
    /// So many bytes.
    Length(u64),
    /// Chunks, up to the last one and its trailer section.
    Chunked,
    /// Up to the connection's close.
    Close,
}

impl Upstreamed {
    /// An answer of the gateway's own, with its body whole.
    pub fn own(status: u16, text: String) -> Upstreamed {
        let headers = vec![("content-type".to_owned(), "text/plain; charset=utf-8".to_owned())];
        Upstreamed { status, reason: None, headers, body: Payload::Whole(text.into_bytes()) }
    }
}

/// An answer the gateway cannot pass on, and why.
fn invalid(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned())
}

/// An answer's status line and header section.
struct Head {
    status: u16,
    reason: Option<String>,
    headers: Vec<(String, String)>,
}

/// The status line and header section of an answer, read off `reader`.
fn read_head(reader: &mut BufReader<Timed>) -> std::io::Result<Head> {
    let mut budget = MAX_HEAD;
    let mut line = Vec::new();
    if !crate::read_line(reader, &mut line, &mut budget)? {
        return Err(invalid("the connection closed, or the status line is too long, before the status line's end"));
    }
    let text = String::from_utf8_lossy(&line);
    let mut parts = text.trim_end().splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    let code = parts.next().filter(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_digit()));
    let status: u16 = code.and_then(|c| c.parse().ok()).ok_or_else(|| invalid("no status line"))?;
    if !version.starts_with("HTTP/1.") || !(100..1000).contains(&status) {
        return Err(invalid("no HTTP/1.x status line"));
    }
    let phrase = parts.next().unwrap_or_default();
    let reason = (!phrase.is_empty() && phrase.bytes().all(|b| b == b' ' || b == b'\t' || b.is_ascii_graphic()))
        .then(|| phrase.to_owned());
    let mut headers = Vec::new();
    loop {
        let mut h = Vec::new();
        if !crate::read_line(reader, &mut h, &mut budget)? {
            return Err(invalid("the header section is cut short, or over 64 KiB"));
        }
        let h = crate::without_eol(&h);
        if h.is_empty() {
            return Ok(Head { status, reason, headers });
        }
        // A bare CR ends a line for some clients, a NUL a string: never passed on in a field.
        let text = |b: &[u8]| String::from_utf8_lossy(b).replace(['\r', '\0'], " ");
        // A line folded onto the one before (obsolete, RFC 9112 5.2) joins it with a space.
        if h.first().is_some_and(|b| *b == b' ' || *b == b'\t') {
            if let Some((_, value)) = headers.last_mut() {
                value.push(' ');
                value.push_str(&text(h.trim_ascii()));
            }
            continue;
        }
        if let Some((name, value)) = crate::field(h) {
            let name = text(name).trim().to_ascii_lowercase();
            let value = text(value);
            headers.push((name, value));
        }
    }
}

/// Sends `out` to `upstream` as `method` `path` and reads its answer's head (past any interim
/// 1xx answer); the body is left on the connection, to be passed on as it comes.
pub fn fetch(upstream: &str, (method, path): (&str, &str), out: &Outbound) -> std::io::Result<Upstreamed> {
    let until = Instant::now().checked_add(UPSTREAM_TIMEOUT);
    let mut stream = ratewall_host::http::connect_within(upstream, UPSTREAM_TIMEOUT)?;
    stream.set_write_timeout(Some(UPSTREAM_TIMEOUT))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nconnection: close\r\n");
    if !out.headers.iter().any(|(k, _)| k == "host") {
        head.push_str(&format!("host: {upstream}\r\n"));
    }
    for (k, v) in &out.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !out.body.is_empty() || method == "POST" || method == "PUT" {
        head.push_str(&format!("content-length: {}\r\n", out.body.len()));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(&out.body);
    stream.write_all(&bytes)?;
    let mut reader = BufReader::new(Timed { stream, until, watch: None });
    let Head { status, reason, headers } = loop {
        let head = read_head(&mut reader)?;
        if head.status == 101 {
            return Err(invalid("the upstream switched protocols, which the gateway does not pass on"));
        }
        if head.status >= 200 {
            break head;
        }
    };
    let values = |name: &'static str| headers.iter().filter(move |(k, _)| k == name).map(|(_, v)| v.as_str());
    // The body's transfer coding: chunked, as HTTP/1.1 has it, or none; another is refused
    // (a 502), as NGINX refuses it, since the client did not say it takes it.
    let codings: Vec<&str> = values("transfer-encoding").flat_map(|v| v.split(',')).map(str::trim).collect();
    let chunked = !codings.is_empty();
    if chunked && !(codings.len() == 1 && codings.iter().all(|c| c.eq_ignore_ascii_case("chunked"))) {
        return Err(invalid("the upstream sent a transfer coding other than chunked"));
    }
    let lengths: Vec<Option<u64>> =
        values("content-length").flat_map(|v| v.split(',')).map(|v| v.trim().parse::<u64>().ok()).collect();
    let framing = if method.eq_ignore_ascii_case("HEAD") || status == 204 || status == 304 {
        Framing::None
    } else if chunked {
        Framing::Chunked
    } else {
        match lengths.split_first() {
            None => Framing::Close,
            Some((None, _)) => return Err(invalid("a content-length that is not a number")),
            Some((Some(first), rest)) if rest.iter().all(|l| *l == Some(*first)) => Framing::Length(*first),
            Some(_) => return Err(invalid("conflicting content-length fields")),
        }
    };
    let named = connection_named(values("connection"));
    let length = lengths.first().copied().flatten();
    let mut passed_on: Vec<(String, String)> = headers.iter().filter(|(k, _)| passed(k, &named)).cloned().collect();
    // A HEAD's or a 304's answer says the length of a body it has not (RFC 9110 8.6).
    if let (Some(l), Framing::None, false) = (length, framing, chunked) {
        if status != 204 {
            passed_on.push(("content-length".to_owned(), l.to_string()));
        }
    }
    // The head came: the body's reads each wait as long as the head had in all.
    reader.get_mut().until = None;
    Ok(Upstreamed { status, reason, headers: passed_on, body: Payload::Coming(reader, framing) })
}

/// Writes `answer` to the client — its status, `headers` (the filter's included), the body's
/// framing and its body, copied from the origin as it comes. A body the origin cuts short
/// ends the client's connection short of its end too, as a proxy that has sent the head
/// already does.
pub fn send_on(
    stream: &mut TcpStream,
    answer: Upstreamed,
    headers: &[(String, String)],
    (head_only, http10): (bool, bool),
) -> std::io::Result<()> {
    let status = answer.status;
    let bodiless = head_only || status == 204 || status == 304;
    let phrase = answer.reason.as_deref().unwrap_or_else(|| reason(status));
    let mut out = format!("HTTP/1.1 {status} {phrase}\r\n");
    for (k, v) in headers {
        if k.starts_with(':') || (k.eq_ignore_ascii_case("content-length") && !bodiless) {
            continue;
        }
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    let mut body = answer.body;
    if !bodiless {
        match &body {
            Payload::Whole(b) => out.push_str(&format!("content-length: {}\r\n", b.len())),
            Payload::Coming(_, Framing::Length(n)) => out.push_str(&format!("content-length: {n}\r\n")),
            Payload::Coming(..) => {}
        }
        // An HTTP/1.0 client knows no transfer codings (RFC 9112 6.1): a chunked body is sent
        // it decoded, up to the close.
        if let (Payload::Coming(_, Framing::Chunked), false) = (&body, http10) {
            out.push_str("transfer-encoding: chunked\r\n");
        }
    }
    out.push_str("connection: close\r\n\r\n");
    stream.write_all(out.as_bytes())?;
    if let Payload::Coming(from, _) = &mut body {
        from.get_mut().watch = stream.try_clone().ok();
    }
    if !bodiless {
        match &mut body {
            Payload::Whole(b) => stream.write_all(b)?,
            Payload::Coming(from, Framing::Length(n)) => {
                let copied = std::io::copy(&mut from.take(*n), stream)?;
                if copied < *n {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
            }
            Payload::Coming(from, Framing::Chunked) => copy_chunked(from, stream, !http10)?,
            Payload::Coming(from, Framing::Close) => {
                std::io::copy(from, stream)?;
            }
            Payload::Coming(_, Framing::None) => {}
        }
    }
    stream.flush()
}

/// Copies a chunked body as it comes, chunk by chunk, through its last chunk and trailer
/// section, framed anew (sizes in hex, CRLF, no extensions; trailer fields that parse and may
/// be trailers) — or, not `chunked`, its data alone; an error when it is malformed or cut
/// short.
fn copy_chunked(from: &mut BufReader<Timed>, to: &mut TcpStream, chunked: bool) -> std::io::Result<()> {
    let mut line = Vec::new();
    let next_line = |from: &mut BufReader<Timed>, line: &mut Vec<u8>| {
        line.clear();
        let mut budget = 4096;
        if !crate::read_line(from, line, &mut budget)? {
            return Err(invalid("a chunk's line is cut short, or too long"));
        }
        let end = crate::without_eol(line).len();
        line.truncate(end);
        Ok(())
    };
    loop {
        next_line(from, &mut line)?;
        let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
        let rest = line.get(digits..).unwrap_or_default();
        if digits == 0
            || !(rest.is_empty() || rest.starts_with(b";") || rest.starts_with(b" ") || rest.starts_with(b"\t"))
        {
            return Err(invalid("a chunk size that is not a number"));
        }
        let hex = std::str::from_utf8(line.get(..digits).unwrap_or_default()).unwrap_or_default();
        let size = u64::from_str_radix(hex, 16).map_err(|_| invalid("a chunk size that is not a number"))?;
        if size == 0 {
            break;
        }
        if chunked {
            to.write_all(format!("{size:x}\r\n").as_bytes())?;
        }
        if std::io::copy(&mut from.take(size), to)? < size {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        next_line(from, &mut line)?;
        if !line.is_empty() {
            return Err(invalid("a chunk longer than its size"));
        }
        if chunked {
            to.write_all(b"\r\n")?;
        }
    }
    // The trailer section, up to its blank line: fields that parse, and are not of the
    // message's framing or connection (RFC 9110 6.5.1), passed on.
    let mut trailers = String::from("0\r\n");
    let mut budget = MAX_HEAD;
    loop {
        next_line(from, &mut line)?;
        if line.is_empty() {
            break;
        }
        // Trailers are a header section too: as much of them as of the head.
        budget = budget.checked_sub(line.len()).ok_or_else(|| invalid("a trailer section over 64 KiB"))?;
        let Some((name, value)) = crate::field(&line) else { continue };
        let name = String::from_utf8_lossy(name).to_ascii_lowercase();
        let value = String::from_utf8_lossy(value).replace(['\r', '\0'], " ");
        let token = !name.is_empty() && name.bytes().all(crate::is_token);
        if token
            && passed(&name, &[])
            && !matches!(
                name.as_str(),
                "host" | "authorization" | "content-encoding" | "content-type" | "content-range"
            )
        {
            trailers.push_str(&format!("{name}: {value}\r\n"));
        }
    }
    if chunked {
        trailers.push_str("\r\n");
        to.write_all(trailers.as_bytes())?;
    }
    Ok(())
}
