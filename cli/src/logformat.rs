//! The access-log formats `ratewall replay` reads: NGINX `log_format` strings (`main` and
//! `combined` by default), Envoy format strings (its default access-log format by default)
//! and ratewall's JSON lines, each read into the same borrowed [`Entry`].

use ratewall_core::Nanos;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;

/// NGINX's predefined `combined` format.
pub const NGINX_COMBINED: &str = r#"$remote_addr - $remote_user [$time_local] "$request" $status $body_bytes_sent "$http_referer" "$http_user_agent""#;

/// The `main` format of the `nginx.conf` NGINX ships (and its packages and container image
/// log with): `combined` and the `X-Forwarded-For` the request came with.
pub const NGINX_MAIN: &str = r#"$remote_addr - $remote_user [$time_local] "$request" $status $body_bytes_sent "$http_referer" "$http_user_agent" "$http_x_forwarded_for""#;

/// Envoy's default access-log format (without its closing newline).
pub const ENVOY_DEFAULT: &str = concat!(
    r#"[%START_TIME%] "%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%" "#,
    r#"%RESPONSE_CODE% %RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION% "#,
    r#"%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% "%REQ(X-FORWARDED-FOR)%" "%REQ(USER-AGENT)%" "#,
    r#""%REQ(X-REQUEST-ID)%" "%REQ(:AUTHORITY)%" "%UPSTREAM_HOST%""#
);

/// One request as a log line gives it, borrowed from the line where it can be.
#[derive(Debug, PartialEq, Eq)]
pub struct Entry<'a> {
    /// When it started, in nanoseconds since the epoch.
    pub ts: Nanos,
    /// How long it took, when the log says (`None`: it does not).
    pub duration: Option<Nanos>,
    /// Its method as written (`None`: the log does not say; `GET` is assumed).
    pub method: Option<Cow<'a, str>>,
    /// Its path, with the query if the log has it.
    pub path: Cow<'a, [u8]>,
    /// The identity headers' values, in the order of the rules' identity (`None`: absent).
    pub headers: Vec<Option<Cow<'a, [u8]>>>,
    /// `X-Forwarded-For`, its fields joined.
    pub xff: Option<Cow<'a, [u8]>>,
    /// The address the request came from (the proxy's peer).
    pub peer: Option<Cow<'a, str>>,
}

/// The headers a replay needs from each line: the rules' identity headers (lower case).
pub struct Wanted {
    names: Vec<String>,
}

impl Wanted {
    /// `names`: the identity headers, lower case, in the rules' order.
    pub fn new(names: Vec<String>) -> Wanted {
        Wanted { names }
    }

    /// Which identity header `name` is (any case), or `XFF` for `X-Forwarded-For`.
    fn index(&self, name: &str) -> Option<usize> {
        if name.eq_ignore_ascii_case("x-forwarded-for") {
            return Some(XFF);
        }
        self.names.iter().position(|n| n.eq_ignore_ascii_case(name))
    }

    /// [`Wanted::index`] for an NGINX `$http_` variable's name (`x_user_id`).
    fn index_nginx(&self, var: &str) -> Option<usize> {
        let same = |n: &str| {
            n.len() == var.len()
                && n.bytes().zip(var.bytes()).all(|(a, b)| a.eq_ignore_ascii_case(&b) || (a == b'-' && b == b'_'))
        };
        if same("x-forwarded-for") {
            return Some(XFF);
        }
        self.names.iter().position(|n| same(n))
    }
}

/// The index [`Wanted`] gives `X-Forwarded-For`.
const XFF: usize = usize::MAX;

/// How a log is written.
pub enum LogFormat {
    /// ratewall's JSON lines: `{"ts", "method", "path", "headers", "ip", "duration_ms"}`.
    Jsonl,
    /// A text format: fields between literal text.
    Text(Template),
}

impl LogFormat {
    /// What to call it in a report.
    pub fn name(&self) -> &str {
        match self {
            LogFormat::Jsonl => "jsonl",
            LogFormat::Text(t) => &t.name,
        }
    }

    /// Reads one line (without its line end). `Err`: why it is not a request.
    pub fn read<'a>(&self, wanted: &Wanted, line: &'a [u8]) -> Result<Entry<'a>, String> {
        match self {
            LogFormat::Jsonl => read_json(wanted, line),
            LogFormat::Text(t) => t.read(wanted, line),
        }
    }
}

/// Which variable syntax a format string is written in.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Syntax {
    /// `$name` and `${name}`.
    Nginx,
    /// `%NAME%`, `%NAME(arg)%`, `%NAME(arg):length%`.
    Envoy,
}

impl Syntax {
    /// The syntax a format string looks written in: Envoy's when it has a `%NAME%` command
    /// operator, else NGINX's.
    pub fn guess(format: &str) -> Syntax {
        let b = format.as_bytes();
        let envoy = b.iter().enumerate().any(|(i, &c)| {
            c == b'%'
                && b.get(i + 1).is_some_and(u8::is_ascii_uppercase)
                && b.get(i + 1..).is_some_and(|rest| {
                    let name = rest.iter().take_while(|c| c.is_ascii_uppercase() || **c == b'_').count();
                    matches!(rest.get(name), Some(b'%' | b'('))
                })
        });
        if envoy {
            Syntax::Envoy
        } else {
            Syntax::Nginx
        }
    }
}

/// Whether `format` holds both Envoy command operators and NGINX variables (`$name`).
pub fn mixes_syntaxes(format: &str) -> bool {
    let b = format.as_bytes();
    let nginx = b.windows(2).any(|w| w[0] == b'$' && (w[1].is_ascii_lowercase() || w[1] == b'{'));
    nginx && Syntax::guess(format) == Syntax::Envoy
}

/// What one variable of a format carries.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Field {
    /// The client address (a port after it is dropped).
    Peer,
    /// A time: RFC 3339 / ISO 8601, NGINX's `$time_local`, or epoch seconds.
    Time,
    /// A time written as a `%START_TIME(…)%` format says, by its index in [`Template`]'s
    /// `times`: the field spans what the format reads, spaces included.
    TimeAs(usize),
    /// NGINX's `$time_local`, always 26 bytes with a space inside (`01/Dec/2026:10:00:11
    /// +0000`): read whole, whatever text follows it in the format.
    TimeLocal,
    /// `METHOD URI PROTOCOL`.
    Request,
    /// The method alone.
    Method,
    /// The path (and query) alone.
    Path,
    /// How long the request took: NGINX's `$request_time` (seconds), Envoy's `%DURATION%`
    /// (milliseconds).
    Duration(Unit),
    /// A request header, by [`Wanted`] index.
    Header(usize),
    /// Something a replay does not need.
    Other,
}

impl Field {
    /// Whether its value is free text, taken as it is: a header's, a path, a field a replay
    /// skips. The others are read by a syntax of their own (an address, a time, a method, a
    /// number, a request line), which a value cut at the wrong place does not pass.
    fn free_text(self) -> bool {
        matches!(self, Field::Header(_) | Field::Path | Field::Other)
    }
}

/// The unit a duration is written in.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Unit {
    Seconds,
    Millis,
}

#[derive(Debug)]
enum Token {
    Literal(Vec<u8>),
    Field(Field),
}

/// A compiled format string.
pub struct Template {
    name: String,
    tokens: Vec<Token>,
    /// The time formats of the format's `%START_TIME(…)%` fields ([`Field::TimeAs`]).
    times: Vec<TimeFormat>,
    /// The index of the last token a replay needs: reading stops after it.
    last_needed: usize,
    syntax: Syntax,
    /// Whether the format has the client address (Envoy's default has only X-Forwarded-For).
    has_peer: bool,
    /// Whether a line must match the whole format, to its end ([`Template::whole_lines`]);
    /// else reading stops after the last field a replay needs.
    whole: bool,
}

impl Template {
    /// Compiles `format` (`name`: what the report calls it). `Err`: why it cannot be read by.
    pub fn compile(name: &str, format: &str, syntax: Syntax, wanted: &Wanted) -> Result<Template, String> {
        let format = without_line_end(format);
        let mut times = Vec::new();
        let mut tokens = match syntax {
            Syntax::Nginx => nginx_tokens(format, wanted)?,
            Syntax::Envoy => envoy_tokens(format, wanted, &mut times)?,
        };
        // Lines are read without their line end, and white space at a line's end is not
        // required: what ends the format ends with the last text that is not white space.
        if let Some(Token::Literal(last)) = tokens.last_mut() {
            last.truncate(last.trim_ascii_end().len());
            if last.is_empty() {
                tokens.pop();
            }
        }
        let has = |f: Field| tokens.iter().any(|t| matches!(t, Token::Field(x) if *x == f));
        if !tokens.iter().any(|t| matches!(t, Token::Field(Field::Time | Field::TimeAs(_) | Field::TimeLocal))) {
            return Err("the format has no time ($time_local, $time_iso8601, $msec or %START_TIME%)".to_owned());
        }
        if !has(Field::Request) && !has(Field::Path) {
            return Err("the format has no path ($request, $request_uri or %REQ(:PATH)%)".to_owned());
        }
        let needed = |t: &Token| matches!(t, Token::Field(f) if *f != Field::Other);
        let last_needed = tokens.iter().rposition(needed).unwrap_or(0);
        // Two variables with nothing between them cannot be told apart.
        for pair in tokens.windows(2) {
            if let [Token::Field(a), Token::Field(b)] = pair {
                if *a != Field::Other || *b != Field::Other {
                    return Err("two variables with nothing between them cannot be told apart".to_owned());
                }
            }
        }
        Ok(Template {
            name: name.to_owned(),
            last_needed,
            syntax,
            has_peer: has(Field::Peer),
            tokens,
            times,
            whole: false,
        })
    }

    /// This format, read only from lines that match all of it, to their end: a format the
    /// operator wrote says what every line is, so a line that is not so is unreadable (the
    /// predefined formats read their fields and leave what a log appends after them).
    pub fn whole_lines(mut self) -> Template {
        self.whole = true;
        self
    }

    fn read<'a>(&self, wanted: &Wanted, line: &'a [u8]) -> Result<Entry<'a>, String> {
        let mut e = Entry {
            ts: 0,
            duration: None,
            method: None,
            path: Cow::Borrowed(&b""[..]),
            headers: vec![None; wanted.names.len()],
            xff: None,
            peer: None,
        };
        let (mut at, mut time, mut path) = (0usize, None, false);
        let read = if self.whole { self.tokens.len() } else { self.last_needed + 1 };
        for (i, token) in self.tokens.iter().enumerate().take(read) {
            let rest = line.get(at..).unwrap_or_default();
            match token {
                Token::Literal(lit) => {
                    if !rest.starts_with(lit) {
                        return Err(format!("expected {:?} at column {}", String::from_utf8_lossy(lit), at + 1));
                    }
                    at += lit.len();
                }
                Token::Field(Field::TimeAs(k)) => {
                    // The format says where the time ends, so a time written with spaces (or
                    // with the next literal text inside it) is read whole.
                    let format = self.times.get(*k).ok_or("no time format")?;
                    let (ts, len) = format.read(rest).ok_or_else(|| {
                        format!("cannot read the time at column {} as {} writes it", at + 1, format.text)
                    })?;
                    time = Some(ts);
                    at += len;
                }
                Token::Field(Field::TimeLocal) => {
                    let raw = rest.get(..26).unwrap_or(rest);
                    let ts = time_local(raw).ok_or_else(|| bad("time", raw, at))?;
                    time = Some(ts);
                    at += 26;
                }
                Token::Field(field) => {
                    let len = match self.tokens.get(i + 1) {
                        Some(Token::Literal(next)) => find(rest, next).ok_or_else(|| {
                            format!("expected {:?} after column {}", String::from_utf8_lossy(next), at + 1)
                        })?,
                        // The format's last field: to the line's end, white space after it left.
                        _ => rest.trim_ascii_end().len(),
                    };
                    let raw = rest.get(..len).unwrap_or_default();
                    // Where the field starts, for messages: they name the field and say where it
                    // is and how long, never what it holds (a header's value may have run into
                    // it, past a space).
                    let start = at;
                    if field.free_text() {
                        self.split_surely(i, raw, start, wanted)?;
                    }
                    at += len;
                    let value = (raw != b"-" && !raw.is_empty()).then_some(raw);
                    match (field, value) {
                        (Field::Other | Field::TimeAs(_) | Field::TimeLocal, _) => {}
                        (Field::Time, v) => {
                            time = Some(v.and_then(parse_time).ok_or_else(|| bad("time", raw, start))?);
                        }
                        (Field::Request, v) => {
                            let (method, uri) =
                                v.and_then(request_line).ok_or_else(|| bad("request line", raw, start))?;
                            e.method = Some(method);
                            e.path = self.unescape(uri);
                            path = true;
                        }
                        (Field::Method, None) => {}
                        (Field::Method, Some(m)) => {
                            e.method = Some(method(m).map(Cow::Borrowed).ok_or_else(|| bad("method", raw, start))?);
                        }
                        (Field::Path, Some(v)) => {
                            e.path = self.unescape(v);
                            path = true;
                        }
                        (Field::Path, None) => return Err(bad("path", raw, start)),
                        (Field::Peer, None) => {}
                        (Field::Peer, Some(v)) => e.peer = Some(Cow::Borrowed(peer(v, start)?)),
                        (Field::Duration(_), None) => {}
                        (Field::Duration(unit), Some(v)) => {
                            e.duration = Some(duration(v, *unit).ok_or_else(|| bad("duration", raw, start))?);
                        }
                        (Field::Header(XFF), v) => e.xff = v.map(|v| self.unescape(v)),
                        (Field::Header(h), v) => {
                            if let Some(slot) = e.headers.get_mut(*h) {
                                *slot = v.map(|v| self.unescape(v));
                            }
                        }
                    }
                }
            }
        }
        if self.whole {
            let rest = line.get(at..).unwrap_or_default();
            if !rest.trim_ascii().is_empty() {
                // Its length, not its text: what a log appends past a format is fields the
                // format does not name, such as a header that carries an API key.
                return Err(format!("{} more bytes from column {}, past the end of the format", rest.len(), at + 1));
            }
        }
        e.ts = time.ok_or("no time")?;
        if self.syntax == Syntax::Nginx {
            // NGINX's times are those of the log write, when the request completed: it started
            // `$request_time` before.
            e.ts = e.ts.saturating_sub(e.duration.unwrap_or(0));
        }
        if !path {
            return Err("no path".to_owned());
        }
        if !self.has_peer {
            // Envoy appends the peer to X-Forwarded-For (with `use_remote_address`): the last
            // entry is the address the proxy saw.
            e.peer = e
                .xff
                .as_deref()
                .and_then(|x| x.rsplit(|&b| b == b',').next())
                .and_then(|last| std::str::from_utf8(last.trim_ascii()).ok().map(|s| Cow::Owned(s.to_owned())));
        }
        Ok(e)
    }

    /// `Ok` when the free-text field at token `i`, read as `raw` from byte `at` of its line, was
    /// surely cut where the line puts its end; `Err` why not, with the field's place and length,
    /// never its text.
    ///
    /// A value ends where the text after it in the format first occurs, so a value that holds
    /// that text (a header's `Bearer eyJ…` before a space) is cut short, and its rest runs into
    /// the fields after it. What ran on shows in a field of free text: it holds the text that
    /// separates it from the free-text field before it, or, last on the line after a space, a
    /// space (the line has more space-separated fields than the format). Either way the line
    /// cannot be split with certainty, so it is unreadable rather than read at a guess: a token
    /// cut at its space would key the request wrongly, and the token's rest would show in
    /// another dimension's key. A quoted value (`"$http_authorization"`) is read whole: NGINX
    /// writes a `"` inside a value as `\x22`.
    fn split_surely(&self, i: usize, raw: &[u8], at: usize, wanted: &Wanted) -> Result<(), String> {
        let token = |back: usize| i.checked_sub(back).and_then(|j| self.tokens.get(j));
        let Some(Token::Literal(sep)) = token(1) else { return Ok(()) };
        // Named only once it is refused: this runs for every free-text field of every line.
        let place = || {
            let name = match self.tokens.get(i) {
                Some(Token::Field(Field::Header(XFF))) => "x-forwarded-for header".to_owned(),
                Some(Token::Field(Field::Header(h))) => {
                    format!("{} header", wanted.names.get(*h).map_or("identity", String::as_str))
                }
                Some(Token::Field(Field::Path)) => "path".to_owned(),
                _ => "field".to_owned(),
            };
            format!("the {name} at column {} ({})", at + 1, bytes(raw.len()))
        };
        let after_free_text = matches!(token(2), Some(Token::Field(f)) if f.free_text());
        if after_free_text && find(raw, sep).is_some() {
            return Err(format!(
                "{} holds the text that separates it from the field before it: the line has more \
                 fields than the format (quote the variables whose values may hold it)",
                place()
            ));
        }
        let last = !matches!(self.tokens.get(i + 1), Some(Token::Literal(_)));
        let spaced = |b: &u8| *b == b' ' || *b == b'\t';
        if last && sep.last().is_some_and(spaced) && raw.iter().any(spaced) {
            return Err(format!(
                "{} holds a space, last on the line after a space: the line has more fields than \
                 the format (quote the variables whose values may hold spaces)",
                place()
            ));
        }
        Ok(())
    }

    /// NGINX writes `"`, `\` and bytes outside printable ASCII as `\xHH`; Envoy writes bytes as
    /// they came.
    fn unescape<'a>(&self, v: &'a [u8]) -> Cow<'a, [u8]> {
        if self.syntax != Syntax::Nginx || find(v, b"\\x").is_none() {
            return Cow::Borrowed(v);
        }
        let mut out = Vec::with_capacity(v.len());
        let mut i = 0;
        while let Some(&b) = v.get(i) {
            let hex = |j: usize| v.get(j).and_then(|c| (*c as char).to_digit(16));
            if let (b'\\', Some(b'x'), Some(h), Some(l)) = (b, v.get(i + 1), hex(i + 2), hex(i + 3)) {
                out.push((h * 16 + l) as u8);
                i += 4;
            } else {
                out.push(b);
                i += 1;
            }
        }
        Cow::Owned(out)
    }
}

/// A format string without the one line end it may close with: Envoy's format strings end
/// in a newline (its documented default ones do, written `\n` in their YAML), as a real one or
/// as the two characters `\n` when copied from a configuration; a log's lines are read
/// without theirs.
fn without_line_end(format: &str) -> &str {
    if let Some(f) = format.strip_suffix('\n') {
        return f.strip_suffix('\r').unwrap_or(f);
    }
    if let Some(f) = format.strip_suffix("\\n") {
        return f.strip_suffix("\\r").unwrap_or(f);
    }
    format
}

/// Why a field that starts at byte `at` of a line cannot be read: the field's name, where it
/// is and how long, never its text (a header's value may have run into it, past a space).
fn bad(what: &str, raw: &[u8], at: usize) -> String {
    format!("cannot read the {what} at column {} ({})", at + 1, bytes(raw.len()))
}

/// `1 byte`, `26 bytes`.
pub fn bytes(n: usize) -> String {
    format!("{n} byte{}", if n == 1 { "" } else { "s" })
}

/// Where `needle` first occurs in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    match needle {
        [] => Some(0),
        [b] => memchr::memchr(*b, hay),
        _ => memchr::memmem::find(hay, needle),
    }
}

/// `METHOD URI PROTOCOL` (HTTP/0.9's `METHOD URI` too).
fn request_line(v: &[u8]) -> Option<(Cow<'_, str>, &[u8])> {
    let sp = memchr::memchr(b' ', v)?;
    let (method, rest) = (v.get(..sp)?, v.get(sp + 1..)?);
    let method = self::method(method)?;
    let uri = match memchr::memrchr(b' ', rest) {
        Some(end) if rest.get(end + 1..).is_some_and(|p| p.starts_with(b"HTTP/")) => rest.get(..end)?,
        _ => rest,
    };
    if uri.is_empty() || uri.contains(&b' ') {
        return None;
    }
    Some((Cow::Borrowed(method), uri))
}

/// A request target in origin form: an absolute-form target (`http://host/v1/a`, as a client
/// sends it to a forward proxy and NGINX's `$request` logs it) loses its scheme and authority,
/// as the proxy's own path does (`/v1/a`; `/` when it names no path).
pub fn origin_form(target: &[u8]) -> &[u8] {
    let after_scheme = [&b"http://"[..], b"https://"].iter().find_map(|scheme| {
        let head = target.get(..scheme.len())?;
        head.eq_ignore_ascii_case(scheme).then(|| target.get(scheme.len()..)).flatten()
    });
    match after_scheme {
        Some(rest) => match memchr::memchr2(b'/', b'?', rest) {
            Some(i) if rest.get(i) == Some(&b'/') => rest.get(i..).unwrap_or(b"/"),
            _ => b"/",
        },
        None => target,
    }
}

/// A method as a log writes it: a token (`GET`, `post`, `M-SEARCH`).
pub fn method(v: &[u8]) -> Option<&str> {
    if !ratewall_core::rules::is_token(v) {
        return None;
    }
    std::str::from_utf8(v).ok()
}

/// The client address of a peer field (at byte `at` of its line), its port dropped. `Err`
/// when the value is no address, a Unix socket's peer among them (NGINX writes `unix:`, Envoy
/// the socket's path): the request cannot be keyed as the proxy keyed it.
fn peer(v: &[u8], at: usize) -> Result<&str, String> {
    if v.starts_with(b"unix:") || v.starts_with(b"/") || v.starts_with(b"@") {
        return Err(format!(
            "the client address at column {} ({}) is a Unix socket's, no address",
            at + 1,
            bytes(v.len())
        ));
    }
    without_port(v)
        .filter(|a| ratewall_core::key::parse_ip(a.as_bytes()).is_some())
        .ok_or_else(|| bad("client address", v, at))
}

/// An address without the port a proxy may write after it (`192.0.2.1:443`,
/// `[2001:db8::1]:443`).
fn without_port(v: &[u8]) -> Option<&str> {
    let s = std::str::from_utf8(v).ok()?;
    if let Some(rest) = s.strip_prefix('[') {
        return rest.split_once(']').map(|(ip, _)| ip);
    }
    match s.rsplit_once(':') {
        // One colon: IPv4 with a port. More: an IPv6 address without brackets.
        Some((ip, port)) if !ip.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => Some(ip),
        _ => Some(s),
    }
}

fn nginx_tokens(format: &str, wanted: &Wanted) -> Result<Vec<Token>, String> {
    let mut tokens = Vec::new();
    let mut lit = Vec::new();
    let b = format.as_bytes();
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        if c != b'$' {
            lit.push(c);
            i += 1;
            continue;
        }
        let (name, next) = if b.get(i + 1) == Some(&b'{') {
            let end = b.get(i + 2..).and_then(|r| r.iter().position(|&c| c == b'}')).ok_or("an unclosed ${")?;
            (format.get(i + 2..i + 2 + end).unwrap_or_default(), i + 3 + end)
        } else {
            let len =
                b.get(i + 1..).unwrap_or_default().iter().take_while(|c| c.is_ascii_alphanumeric() || **c == b'_');
            let len = len.count();
            (format.get(i + 1..i + 1 + len).unwrap_or_default(), i + 1 + len)
        };
        if name.is_empty() {
            return Err(format!("a $ without a variable name at column {}", i + 1));
        }
        let field = match name {
            "remote_addr" | "realip_remote_addr" => Field::Peer,
            "time_local" => Field::TimeLocal,
            "time_iso8601" | "msec" => Field::Time,
            "request" => Field::Request,
            "request_method" => Field::Method,
            "request_uri" | "uri" | "document_uri" => Field::Path,
            "request_time" => Field::Duration(Unit::Seconds),
            _ => match name.strip_prefix("http_").and_then(|h| wanted.index_nginx(h)) {
                Some(h) => Field::Header(h),
                None => Field::Other,
            },
        };
        if !lit.is_empty() {
            tokens.push(Token::Literal(std::mem::take(&mut lit)));
        }
        tokens.push(Token::Field(field));
        i = next;
    }
    if !lit.is_empty() {
        tokens.push(Token::Literal(lit));
    }
    Ok(tokens)
}

/// An Envoy format string's tokens; the time formats its `%START_TIME(…)%` fields give are
/// pushed onto `times`.
fn envoy_tokens(format: &str, wanted: &Wanted, times: &mut Vec<TimeFormat>) -> Result<Vec<Token>, String> {
    let mut tokens = Vec::new();
    let mut lit = Vec::new();
    let mut rest = format;
    while let Some(start) = rest.find('%') {
        lit.extend_from_slice(rest.get(..start).unwrap_or_default().as_bytes());
        let after = rest.get(start + 1..).unwrap_or_default();
        // `%NAME%`, `%NAME(arg)%`, `%NAME(arg):N%`; the argument may hold `%` (START_TIME's).
        let name_len = after.bytes().take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == b'_').count();
        let (name, mut tail) = after.split_at(name_len);
        if name.is_empty() {
            // A `%` that starts no command operator is text.
            lit.push(b'%');
            rest = after;
            continue;
        }
        let mut arg = "";
        if let Some(t) = tail.strip_prefix('(') {
            let close = t.find(')').ok_or_else(|| format!("%{name}( has no closing )"))?;
            arg = t.get(..close).unwrap_or_default();
            tail = t.get(close + 1..).unwrap_or_default();
        }
        if let Some(t) = tail.strip_prefix(':') {
            tail = t.trim_start_matches(|c: char| c.is_ascii_digit());
        }
        tail = tail.strip_prefix('%').ok_or_else(|| format!("%{name} has no closing %"))?;
        let field = match name {
            "START_TIME" if arg.is_empty() => Field::Time,
            "START_TIME" => {
                times.push(TimeFormat::compile(arg).map_err(|why| format!("%START_TIME({arg})%: {why}"))?);
                Field::TimeAs(times.len() - 1)
            }
            "DURATION" => Field::Duration(Unit::Millis),
            "DOWNSTREAM_REMOTE_ADDRESS"
            | "DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT"
            | "DOWNSTREAM_DIRECT_REMOTE_ADDRESS"
            | "DOWNSTREAM_DIRECT_REMOTE_ADDRESS_WITHOUT_PORT" => Field::Peer,
            "REQ" => {
                let alternatives: Vec<&str> = arg.split('?').collect();
                if alternatives.iter().any(|a| a.eq_ignore_ascii_case(":path")) {
                    Field::Path
                } else if arg.eq_ignore_ascii_case(":method") {
                    Field::Method
                } else {
                    match alternatives.first().and_then(|h| wanted.index(h)) {
                        Some(h) => Field::Header(h),
                        None => Field::Other,
                    }
                }
            }
            _ => Field::Other,
        };
        if !lit.is_empty() {
            tokens.push(Token::Literal(std::mem::take(&mut lit)));
        }
        tokens.push(Token::Field(field));
        rest = tail;
    }
    lit.extend_from_slice(rest.as_bytes());
    if !lit.is_empty() {
        tokens.push(Token::Literal(lit));
    }
    Ok(tokens)
}

// ---- times ----

/// A `%START_TIME(…)%` format: Envoy's strftime-like time format, compiled to be read back.
/// It reads `%Y %m %d %e %j %H %M %S %T %F %z %b %B %a %A %s %%`, Envoy's fractions of a
/// second `%f` (9 digits) and `%1f` to `%9f` (that many), and literal text; a time without
/// `%z` (or `%s`) is UTC, as Envoy writes `%START_TIME%`.
pub struct TimeFormat {
    /// The format as written, for messages.
    text: String,
    pieces: Vec<TimePiece>,
}

/// A stretch of a [`TimeFormat`]: what chrono reads, or Envoy's fraction of a second of so
/// many digits (chrono's `%f` reads a count of nanoseconds, and its fractions without a dot
/// only 3, 6 or 9 digits).
enum TimePiece {
    Chrono(Vec<chrono::format::Item<'static>>),
    Fraction(u32),
    /// `%s`: seconds since the epoch, of as many digits as there are, but for the `n` that a
    /// fraction right after it takes (`%s%3f` writes `1796119200123`).
    Epoch(u32),
}

impl TimeFormat {
    /// Compiles a `%START_TIME(…)%` argument. `Err`: a specifier it cannot read, or a format
    /// that gives no instant (no `%s`, and no date or no hour and minute).
    pub fn compile(format: &str) -> Result<TimeFormat, String> {
        use chrono::format::{Fixed, Item, Numeric, Pad};
        const READS: &str = "%Y %m %d %e %j %H %M %S %T %F %z %b %B %a %A %s %f %1f to %9f, %%";
        let mut pieces = Vec::new();
        let mut items: Vec<Item<'static>> = Vec::new();
        let mut lit = String::new();
        // The parts of an instant the specifiers give (`Y`, `m`, `d`, `j`, `H`, `M`, `S`, `s`).
        let mut gave = String::new();
        let mut chars = format.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                lit.push(c);
                continue;
            }
            let spec = chars.next().ok_or("a % at the end of the format names no specifier")?;
            if spec == '%' {
                lit.push('%');
                continue;
            }
            if !lit.is_empty() {
                items.push(Item::OwnedLiteral(std::mem::take(&mut lit).into_boxed_str()));
            }
            let fraction = match spec.to_digit(10) {
                _ if spec == 'f' => Some(9),
                Some(n @ 1..=9) if chars.as_str().starts_with('f') => {
                    chars.next();
                    Some(n)
                }
                _ => None,
            };
            if let Some(n) = fraction {
                if !items.is_empty() {
                    pieces.push(TimePiece::Chrono(std::mem::take(&mut items)));
                }
                if let Some(TimePiece::Epoch(leaves)) = pieces.last_mut() {
                    *leaves = n;
                }
                pieces.push(TimePiece::Fraction(n));
                continue;
            }
            if spec == 's' {
                if !items.is_empty() {
                    pieces.push(TimePiece::Chrono(std::mem::take(&mut items)));
                }
                pieces.push(TimePiece::Epoch(0));
                gave.push('s');
                continue;
            }
            let num = |n: Numeric| Item::Numeric(n, Pad::Zero);
            let (hour, minute, second) = (num(Numeric::Hour), num(Numeric::Minute), num(Numeric::Second));
            let (year, month, day) = (num(Numeric::Year), num(Numeric::Month), num(Numeric::Day));
            // What each reads, and which parts of an instant it gives.
            let (read, gives): (Vec<Item<'static>>, &str) = match spec {
                'Y' => (vec![year], "Y"),
                'm' => (vec![month], "m"),
                'd' => (vec![day], "d"),
                'e' => (vec![Item::Numeric(Numeric::Day, Pad::Space)], "d"),
                'j' => (vec![num(Numeric::Ordinal)], "j"),
                'H' => (vec![hour], "H"),
                'M' => (vec![minute], "M"),
                'S' => (vec![second], "S"),
                'T' => (vec![hour, Item::Literal(":"), minute, Item::Literal(":"), second], "HMS"),
                'F' => (vec![year, Item::Literal("-"), month, Item::Literal("-"), day], "Ymd"),
                'z' => (vec![Item::Fixed(Fixed::TimezoneOffset)], ""),
                'b' => (vec![Item::Fixed(Fixed::ShortMonthName)], "m"),
                'B' => (vec![Item::Fixed(Fixed::LongMonthName)], "m"),
                'a' => (vec![Item::Fixed(Fixed::ShortWeekdayName)], ""),
                'A' => (vec![Item::Fixed(Fixed::LongWeekdayName)], ""),
                other => return Err(format!("%{other} is not a time specifier replay reads (it reads {READS})")),
            };
            items.extend(read);
            gave.push_str(gives);
        }
        if !lit.is_empty() {
            items.push(Item::OwnedLiteral(lit.into_boxed_str()));
        }
        if !items.is_empty() {
            pieces.push(TimePiece::Chrono(items));
        }
        let has = |c: char| gave.contains(c);
        let date = has('Y') && (has('m') && has('d') || has('j'));
        let instant = has('s') || date && has('H') && has('M');
        if !instant {
            return Err("gives no instant: it needs %s, or a date (%Y with %m or %b and %d, or with %j) and %H and %M"
                .to_owned());
        }
        Ok(TimeFormat { text: format.to_owned(), pieces })
    }

    /// Reads the time this format writes from the start of `text`: nanoseconds since the epoch
    /// and how many bytes the time spans. `None`: `text` does not start with such a time (or
    /// with one before the epoch).
    pub fn read(&self, text: &[u8]) -> Option<(Nanos, usize)> {
        let s = match std::str::from_utf8(text) {
            Ok(s) => s,
            // What follows the time may be in any encoding: the time is what is read.
            Err(e) => std::str::from_utf8(text.get(..e.valid_up_to())?).ok()?,
        };
        let mut parsed = chrono::format::Parsed::new();
        let mut rest = s;
        for piece in &self.pieces {
            match piece {
                TimePiece::Chrono(items) => {
                    rest = chrono::format::parse_and_remainder(&mut parsed, rest, items.iter()).ok()?;
                }
                TimePiece::Epoch(leaves) => {
                    let run = rest.bytes().take_while(u8::is_ascii_digit).count();
                    let len = run.checked_sub(*leaves as usize).filter(|l| *l > 0)?;
                    parsed.set_timestamp(i64::try_from(digits(rest.as_bytes().get(..len)?)?).ok()?).ok()?;
                    rest = rest.get(len..)?;
                }
                TimePiece::Fraction(n) => {
                    // Exactly `n` digits of a fraction: `%3f` writes 7 ms as `007`.
                    let len = *n as usize;
                    let nanos = digits(rest.as_bytes().get(..len)?)?.checked_mul(10u64.pow(9 - n))?;
                    parsed.set_nanosecond(i64::try_from(nanos).ok()?).ok()?;
                    rest = rest.get(len..)?;
                }
            }
        }
        if parsed.offset().is_none() {
            parsed.set_offset(0).ok()?;
        }
        let t = parsed.to_datetime().ok()?;
        Some((u64::try_from(t.timestamp_nanos_opt()?).ok()?, s.len() - rest.len()))
    }
}

/// A time as the formats write it: RFC 3339 / ISO 8601 (`2026-12-01T10:00:00.250Z`,
/// `2026-12-01T11:00:00+01:00`), NGINX's `$time_local` (`01/Dec/2026:10:00:00 +0000`), or
/// seconds since the epoch (`1796119200.250`).
pub fn parse_time(v: &[u8]) -> Option<Nanos> {
    match v.get(2) {
        Some(b'/') => time_local(v),
        _ if v.get(4) == Some(&b'-') => rfc3339(v),
        _ => epoch_seconds(v),
    }
}

/// A duration written in decimal in `unit` (`0.004` seconds, `12` or `12.5` milliseconds),
/// exact to the nanosecond.
pub fn duration(text: &[u8], unit: Unit) -> Option<Nanos> {
    let (whole, frac) = match memchr::memchr(b'.', text) {
        Some(dot) => (text.get(..dot)?, text.get(dot + 1..).filter(|f| !f.is_empty())?),
        None => (text, &b""[..]),
    };
    if whole.len() > 12 || !frac.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let (scale, places) = match unit {
        Unit::Seconds => (1_000_000_000, 9),
        Unit::Millis => (1_000_000, 6),
    };
    let mut part = 0u64;
    for i in 0..places {
        part = part * 10 + frac.get(i).map_or(0, |b| u64::from(b - b'0'));
    }
    digits(whole)?.checked_mul(scale)?.checked_add(part)
}

/// Seconds since the epoch written in decimal, exact to the nanosecond (read from the text,
/// not through a float: an f64 has 16 digits).
pub fn epoch_seconds(text: &[u8]) -> Option<Nanos> {
    let (secs, frac) = match memchr::memchr(b'.', text) {
        Some(dot) => (text.get(..dot)?, text.get(dot + 1..)?),
        None => (text, &b""[..]),
    };
    if secs.is_empty()
        || secs.len() > 11
        || !secs.iter().all(u8::is_ascii_digit)
        || !frac.iter().all(u8::is_ascii_digit)
    {
        return None;
    }
    let secs = digits(secs)?;
    let mut nanos = 0u64;
    for i in 0..9 {
        nanos = nanos * 10 + frac.get(i).map_or(0, |b| u64::from(b - b'0'));
    }
    secs.checked_mul(1_000_000_000)?.checked_add(nanos)
}

fn digits(d: &[u8]) -> Option<u64> {
    if d.is_empty() || !d.iter().all(u8::is_ascii_digit) {
        return None;
    }
    d.iter().try_fold(0u64, |n, &b| n.checked_mul(10)?.checked_add(u64::from(b - b'0')))
}

fn num(v: &[u8], from: usize, len: usize) -> Option<u64> {
    digits(v.get(from..from + len)?)
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar (negative before it;
/// `None` for a day the month does not have).
fn days_since_epoch(y: u64, m: u64, d: u64) -> Option<i64> {
    let leap = (y.is_multiple_of(4) && !y.is_multiple_of(100)) || y.is_multiple_of(400);
    let month_days = [31, if leap { 29 } else { 28 }, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    if !(1..=12).contains(&m) || d == 0 || d > *month_days.get(usize::try_from(m - 1).ok()?)? || y == 0 {
        return None;
    }
    // Counted from 0000-03-01, so the leap day ends a year.
    let (y, m) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let days = y * 365 + y / 4 - y / 100 + y / 400 + (153 * m + 2) / 5 + d - 1;
    i64::try_from(days).ok().map(|d| d - 719_468)
}

/// Nanoseconds since the epoch of a date and time written at an offset east of UTC (`None`
/// before the epoch).
fn instant(ymd: (u64, u64, u64), hms: (u64, u64, u64), nanos: u64, offset_east_s: i64) -> Option<Nanos> {
    let (h, mi, s) = hms;
    if h > 23 || mi > 59 || s > 59 {
        return None;
    }
    let clock = i64::try_from(h * 3600 + mi * 60 + s).ok()?;
    let local = days_since_epoch(ymd.0, ymd.1, ymd.2)?.checked_mul(86_400)?.checked_add(clock)?;
    let utc = u64::try_from(local.checked_sub(offset_east_s)?).ok()?;
    utc.checked_mul(1_000_000_000)?.checked_add(nanos)
}

/// `+hhmm`, `-hh:mm` or `Z`, in seconds east of UTC.
fn offset(v: &[u8]) -> Option<i64> {
    if v == b"Z" || v == b"z" {
        return Some(0);
    }
    let sign = match v.first()? {
        b'+' => 1,
        b'-' => -1,
        _ => return None,
    };
    let (h, m) = match v.len() {
        5 => (num(v, 1, 2)?, num(v, 3, 2)?),
        6 if v.get(3) == Some(&b':') => (num(v, 1, 2)?, num(v, 4, 2)?),
        _ => return None,
    };
    if h > 23 || m > 59 {
        return None;
    }
    Some(sign * i64::try_from(h * 3600 + m * 60).ok()?)
}

/// `01/Dec/2026:10:00:00 +0000`.
fn time_local(v: &[u8]) -> Option<Nanos> {
    const MONTHS: [&[u8]; 12] =
        [b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov", b"Dec"];
    if v.len() != 26 || v.get(6) != Some(&b'/') || v.get(11) != Some(&b':') || v.get(20) != Some(&b' ') {
        return None;
    }
    let month = MONTHS.iter().position(|m| Some(*m) == v.get(3..6))? as u64 + 1;
    let (d, y) = (num(v, 0, 2)?, num(v, 7, 4)?);
    let (h, mi, s) = (num(v, 12, 2)?, num(v, 15, 2)?, num(v, 18, 2)?);
    if v.get(14) != Some(&b':') || v.get(17) != Some(&b':') {
        return None;
    }
    instant((y, month, d), (h, mi, s), 0, offset(v.get(21..)?)?)
}

/// `2026-12-01T10:00:00.250Z`, `2026-12-01T11:00:00+01:00`; other RFC 3339 spellings through
/// chrono.
pub fn rfc3339(v: &[u8]) -> Option<Nanos> {
    let fast = || {
        if v.get(7) != Some(&b'-') || v.get(10) != Some(&b'T') || v.get(13) != Some(&b':') || v.get(16) != Some(&b':') {
            return None;
        }
        let ymd = (num(v, 0, 4)?, num(v, 5, 2)?, num(v, 8, 2)?);
        let hms = (num(v, 11, 2)?, num(v, 14, 2)?, num(v, 17, 2)?);
        let mut at = 19;
        let mut nanos = 0u64;
        if v.get(at) == Some(&b'.') {
            let frac = v.get(at + 1..)?.iter().take_while(|b| b.is_ascii_digit()).count();
            if frac == 0 {
                return None;
            }
            for i in 0..9 {
                nanos = nanos * 10 + if i < frac { u64::from(v.get(at + 1 + i)? - b'0') } else { 0 };
            }
            at += 1 + frac;
        }
        instant(ymd, hms, nanos, offset(v.get(at..)?)?)
    };
    fast().or_else(|| {
        let t = chrono::DateTime::parse_from_rfc3339(std::str::from_utf8(v).ok()?).ok()?;
        u64::try_from(t.timestamp_nanos_opt()?).ok()
    })
}

// ---- JSON lines ----

/// A JSON line's fields, borrowed from its text (a string with escapes is copied).
struct JsonLine<'a> {
    ts: Option<&'a RawValue>,
    duration_ms: Option<&'a RawValue>,
    method: Option<Cow<'a, str>>,
    path: Option<Cow<'a, str>>,
    headers: Vec<Option<Cow<'a, str>>>,
    xff: Vec<Cow<'a, str>>,
    ip: Option<Cow<'a, str>>,
}

/// Reads a JSON line in one pass, keeping only the identity headers. `Err` for a line of
/// another shape (a field of another type): the caller reads those as a `Value`, which says
/// what is wrong.
fn read_json<'a>(wanted: &Wanted, line: &'a [u8]) -> Result<Entry<'a>, String> {
    // One UTF-8 check of the whole line, rather than one per string.
    let line = std::str::from_utf8(line).map_err(|e| e.to_string())?;
    let mut de = serde_json::Deserializer::from_str(line);
    let l = LineSeed(wanted).deserialize(&mut de).map_err(|e| e.to_string())?;
    de.end().map_err(|e| e.to_string())?;
    let ts = l.ts.and_then(|raw| json_time(raw.get())).ok_or("no \"ts\"")?;
    let path = l.path.ok_or("no \"path\"")?;
    // What the `Value` reading refuses, this one does too (its message is that reading's).
    let duration = match l.duration_ms.map(RawValue::get) {
        None | Some("null") => None,
        Some(raw) => Some(json_duration(raw).ok_or("cannot read \"duration_ms\"")?),
    };
    if l.method.as_deref().is_some_and(|m| method(m.as_bytes()).is_none()) {
        return Err("cannot read the method".to_owned());
    }
    if l.ip.as_deref().is_some_and(|ip| ratewall_core::key::parse_ip(ip.as_bytes()).is_none()) {
        return Err("cannot read the client address".to_owned());
    }
    let bytes = |c: Cow<'a, str>| match c {
        Cow::Borrowed(s) => Cow::Borrowed(s.as_bytes()),
        Cow::Owned(s) => Cow::Owned(s.into_bytes()),
    };
    let xff = match l.xff.len() {
        0 => None,
        1 => l.xff.into_iter().next().map(bytes),
        _ => Some(Cow::Owned(l.xff.join(", ").into_bytes())),
    };
    Ok(Entry {
        ts,
        duration,
        method: l.method,
        path: bytes(path),
        headers: l.headers.into_iter().map(|h| h.map(bytes)).collect(),
        xff,
        peer: l.ip,
    })
}

/// A time as a JSON line writes it: a number of seconds since the epoch, or a string of RFC
/// 3339 or of seconds since the epoch (`"1796119200.250"`).
pub fn json_time(text: &str) -> Option<Nanos> {
    if text.starts_with('"') {
        let s: Cow<'_, str> = serde_json::from_str::<CowStr<'_>>(text).ok()?.0;
        return time_string(&s);
    }
    epoch_seconds(text.as_bytes())
}

/// A JSON line's `duration_ms`: milliseconds, a number or a string (`12.5`, `"12.5"`).
pub fn json_duration(text: &str) -> Option<Nanos> {
    if text.starts_with('"') {
        let s: Cow<'_, str> = serde_json::from_str::<CowStr<'_>>(text).ok()?.0;
        return duration(s.as_bytes(), Unit::Millis);
    }
    duration(text.as_bytes(), Unit::Millis)
}

/// A time a JSON line writes as a string: RFC 3339, or seconds since the epoch.
pub fn time_string(s: &str) -> Option<Nanos> {
    epoch_seconds(s.as_bytes()).or_else(|| rfc3339(s.as_bytes()))
}

/// A string borrowed from the input when it has no escapes.
struct CowStr<'a>(Cow<'a, str>);

impl<'de> serde::Deserialize<'de> for CowStr<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(CowStrVisitor)
    }
}

struct CowStrVisitor;

impl<'de> Visitor<'de> for CowStrVisitor {
    type Value = CowStr<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(CowStr(Cow::Borrowed(v)))
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(CowStr(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(CowStr(Cow::Owned(v)))
    }
}

/// An optional string field (`null` reads as absent).
struct OptStr<'a>(Option<Cow<'a, str>>);

impl<'de> serde::Deserialize<'de> for OptStr<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Option::<CowStr<'de>>::deserialize(d).map(|o| OptStr(o.map(|c| c.0)))
    }
}

struct LineSeed<'w>(&'w Wanted);

impl<'de> DeserializeSeed<'de> for LineSeed<'_> {
    type Value = JsonLine<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for LineSeed<'_> {
    type Value = JsonLine<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut line = JsonLine {
            ts: None,
            duration_ms: None,
            method: None,
            path: None,
            headers: vec![None; self.0.names.len()],
            xff: Vec::new(),
            ip: None,
        };
        while let Some(key) = map.next_key::<CowStr<'de>>()? {
            match &*key.0 {
                "ts" => line.ts = Some(map.next_value()?),
                "duration_ms" => line.duration_ms = Some(map.next_value()?),
                "method" => line.method = map.next_value::<OptStr<'de>>()?.0,
                "path" => line.path = map.next_value::<OptStr<'de>>()?.0,
                "ip" => line.ip = map.next_value::<OptStr<'de>>()?.0,
                "headers" => map.next_value_seed(HeadersSeed { wanted: self.0, line: &mut line })?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(line)
    }
}

/// The `headers` field: an object of name → value (a string, or a list of strings for a
/// field sent several times), or a list of `[name, value]` pairs; `null` for no headers, or
/// for a header's value, is absent. Anything else is an error: the line is not a request.
struct HeadersSeed<'w, 'l, 'de> {
    wanted: &'w Wanted,
    line: &'l mut JsonLine<'de>,
}

impl<'w, 'l, 'de> HeadersSeed<'w, 'l, 'de> {
    fn put(&mut self, index: usize, value: Cow<'de, str>) {
        if index == XFF {
            self.line.xff.push(value);
        } else if let Some(slot) = self.line.headers.get_mut(index) {
            if slot.is_none() && !value.is_empty() {
                *slot = Some(value);
            }
        }
    }
}

impl<'de> DeserializeSeed<'de> for HeadersSeed<'_, '_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for HeadersSeed<'_, '_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object of headers or a list of [name, value] pairs")
    }
    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        while let Some(name) = map.next_key::<CowStr<'de>>()? {
            // Every value is checked, a header the rules do not key on too: a line of another
            // shape is not a request.
            let values = map.next_value::<Strings<'de>>()?.0;
            if let Some(index) = self.wanted.index(&name.0) {
                for v in values {
                    self.put(index, v);
                }
            }
        }
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<(), A::Error> {
        while let Some(Pair(name, value)) = seq.next_element::<Pair<'de>>()? {
            if let (Some(index), Some(value)) = (self.wanted.index(&name), value) {
                self.put(index, value);
            }
        }
        Ok(())
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        Ok(())
    }
}

/// A header's value: a string, or the strings of a list (`null`: none). Other values are
/// errors (the visitor's defaults).
struct Strings<'a>(Vec<Cow<'a, str>>);

impl<'de> serde::Deserialize<'de> for Strings<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StringsVisitor)
    }
}

struct StringsVisitor;

impl<'de> Visitor<'de> for StringsVisitor {
    type Value = Strings<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string or a list of strings")
    }
    fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Strings(vec![Cow::Borrowed(v)]))
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Strings(vec![Cow::Owned(v.to_owned())]))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element::<CowStr<'de>>()? {
            out.push(v.0);
        }
        Ok(Strings(out))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(Strings(Vec::new()))
    }
}

/// One `[name, value]` pair of a headers list: two strings (the value may be `null`: absent).
struct Pair<'a>(Cow<'a, str>, Option<Cow<'a, str>>);

impl<'de> serde::Deserialize<'de> for Pair<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_seq(PairVisitor)
    }
}

struct PairVisitor;

impl<'de> Visitor<'de> for PairVisitor {
    type Value = Pair<'de>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a [name, value] pair of strings")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        use serde::de::Error as _;
        let name = seq.next_element::<CowStr<'de>>()?.ok_or_else(|| A::Error::invalid_length(0, &self))?;
        let value = seq.next_element::<OptStr<'de>>()?.ok_or_else(|| A::Error::invalid_length(1, &self))?;
        if seq.next_element::<IgnoredAny>()?.is_some() {
            return Err(A::Error::invalid_length(3, &self));
        }
        Ok(Pair(name.0, value.0))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use super::*;

    fn wanted() -> Wanted {
        Wanted::new(vec!["x-user-id".to_owned(), "x-api-key".to_owned()])
    }

    /// The hand-written time readers agree with chrono over a sweep of instants and offsets.
    #[test]
    fn times_read_as_chrono_reads_them() {
        use chrono::{DateTime, FixedOffset};
        let mut t: i64 = 0;
        while t < 4_102_444_800 {
            for off in [0, 3600, -7 * 3600, 5 * 3600 + 1800] {
                let tz = FixedOffset::east_opt(off).unwrap();
                let d: DateTime<FixedOffset> = DateTime::from_timestamp(t, 250_000_000).unwrap().with_timezone(&tz);
                let want = Some(u64::try_from(t).unwrap() * 1_000_000_000);
                let local = d.format("%d/%b/%Y:%H:%M:%S %z").to_string();
                assert_eq!(parse_time(local.as_bytes()), want, "{local}");
                let iso = d.format("%Y-%m-%dT%H:%M:%S%:z").to_string();
                assert_eq!(parse_time(iso.as_bytes()), want, "{iso}");
                let ms = d.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
                assert_eq!(parse_time(ms.as_bytes()), want.map(|n| n + 250_000_000), "{ms}");
            }
            t += 86_400 * 17 + 3_607;
        }
        assert_eq!(parse_time(b"1796119200.250"), Some(1_796_119_200_250_000_000));
        for bad in [
            &b"31/Feb/2026:10:00:00 +0000"[..],
            b"01/Foo/2026:10:00:00 +0000",
            b"01/Dec/2026:24:00:00 +0000",
            b"1969-12-31T23:59:59Z",
            b"-",
            b"",
            b"12.3.4",
        ] {
            assert_eq!(parse_time(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn nginx_combined_reads_the_request_and_the_peer() {
        let f = Template::compile("c", NGINX_COMBINED, Syntax::Nginx, &wanted()).unwrap();
        let line = br#"2001:db8::1 - alice [01/Dec/2026:10:00:00 +0100] "post /v1/a%2Fb?x=\x22y HTTP/1.1" 200 5 "-" "a \x22quoted\x22 agent""#;
        let e = f.read(&wanted(), line).unwrap();
        assert_eq!(e.ts, 1_796_115_600_000_000_000);
        assert_eq!(e.method.as_deref(), Some("post"));
        assert_eq!(&*e.path, b"/v1/a%2Fb?x=\"y");
        assert_eq!(e.peer.as_deref(), Some("2001:db8::1"));
        assert!(f.read(&wanted(), br#"1.2.3.4 - - [01/Dec/2026:10:00:00 +0000] "\x16\x03" 400 0 "-" "-""#).is_err());
        assert!(f.read(&wanted(), b"1.2.3.4 - - [01/Dec/2026:10:00:00 +0000]").is_err());
    }

    #[test]
    fn an_absolute_form_target_is_read_as_the_path_the_proxy_sees() {
        for (target, path) in [
            (&b"http://example.com/v1/abs?x=1"[..], &b"/v1/abs?x=1"[..]),
            (b"HTTPS://example.com:8443/v1/a", b"/v1/a"),
            (b"http://example.com", b"/"),
            (b"http://example.com?q=/x", b"/"),
            (b"/v1/a", b"/v1/a"),
            (b"*", b"*"),
            (b"httpx://h/a", b"httpx://h/a"),
        ] {
            assert_eq!(origin_form(target), path, "{}", String::from_utf8_lossy(target));
        }
    }

    #[test]
    fn format_strings_name_the_headers_they_log() {
        let w = wanted();
        let f = Template::compile(
            "n",
            r#"${remote_addr} $msec "$request_method $request_uri" "$http_x_forwarded_for" $http_X_API_KEY"#,
            Syntax::Nginx,
            &w,
        )
        .unwrap();
        let e = f.read(&w, br#"10.0.0.1 1796119200.5 "GET /a" "203.0.113.9, 10.0.0.1" k1"#).unwrap();
        assert_eq!(
            (e.headers[1].as_deref(), e.xff.as_deref()),
            (Some(&b"k1"[..]), Some(&b"203.0.113.9, 10.0.0.1"[..]))
        );
        assert_eq!(e.headers[0], None);
        let f = Template::compile("e", ENVOY_DEFAULT, Syntax::Envoy, &w).unwrap();
        let e = f
            .read(&w, br#"[2026-12-01T10:00:00.250Z] "GET /x HTTP/2" 200 - 0 1 2 1 "198.51.100.1,10.1.1.1" "ua" "id" "host" "10.0.0.2:80""#)
            .unwrap();
        assert_eq!(e.ts, 1_796_119_200_250_000_000);
        assert_eq!(e.peer.as_deref(), Some("10.1.1.1"), "the last X-Forwarded-For entry: the address Envoy saw");
        assert_eq!(Syntax::guess(ENVOY_DEFAULT), Syntax::Envoy);
        assert_eq!(Syntax::guess(NGINX_COMBINED), Syntax::Nginx);
        assert_eq!(Syntax::guess("$remote_addr 100%"), Syntax::Nginx);
        for (bad, why) in [
            ("$remote_addr $status", "no time"),
            ("$msec $status", "no path"),
            ("$msec$request", "cannot be told apart"),
            ("$msec $ x", "without a variable"),
        ] {
            let e = Template::compile("b", bad, Syntax::Nginx, &w).err().unwrap();
            assert!(e.contains(why), "{bad}: {e}");
        }
        assert!(Template::compile("b", "%START_TIME %REQ(:PATH)%", Syntax::Envoy, &w).is_err());
    }

    #[test]
    fn time_local_is_read_whole_where_no_brackets_enclose_it() {
        let w = wanted();
        let f = Template::compile("n", "$remote_addr $time_local $request_method $uri", Syntax::Nginx, &w).unwrap();
        let e = f.read(&w, b"10.0.0.1 01/Dec/2026:10:00:00 +0100 GET /v1/a").unwrap();
        assert_eq!((e.ts, e.path.as_ref()), (1_796_115_600_000_000_000, &b"/v1/a"[..]));
        let e = f.read(&w, b"10.0.0.1 01/Dec/2026:10:00 GET /v1/a").err().unwrap();
        assert!(e.starts_with("cannot read the time at column 10"), "{e}");
    }

    #[test]
    fn a_format_string_of_ones_own_reads_only_lines_that_match_all_of_it() {
        let w = wanted();
        let text = r#"$remote_addr [$time_iso8601] "$request" key="$http_x_api_key" ua="$http_user_agent""#;
        let own = Template::compile("n", text, Syntax::Nginx, &w).unwrap().whole_lines();
        let good = br#"192.0.2.1 [2026-12-01T10:00:00+00:00] "GET /a HTTP/1.1" key="k1" ua="-""#;
        assert_eq!(own.read(&w, good).unwrap().headers[1].as_deref(), Some(&b"k1"[..]));
        for (line, why) in [
            (&br#"192.0.2.1 [2026-12-01T10:00:00+00:00] "GET /a HTTP/1.1" key="k1" ua="-" extra"#[..], "past the end"),
            (br#"192.0.2.1 [2026-12-01T10:00:00+00:00] "GET /a HTTP/1.1" key="k1""#, "expected"),
            (br#"not an address [2026-12-01T10:00:00+00:00] "GET /a HTTP/1.1" key="k1" ua="-""#, "client address"),
            (br#"192.0.2.1 - - [01/Dec/2026:10:00:00 +0000] "GET / HTTP/1.1" 200 0 "-" "-""#, "client address"),
        ] {
            let e = own.read(&w, line).err().unwrap_or_else(|| panic!("{}", String::from_utf8_lossy(line)));
            assert!(e.contains(why), "{}: {e}", String::from_utf8_lossy(line));
        }
        // A method alone must be one.
        let f = Template::compile("m", "$msec $request_method $request_uri", Syntax::Nginx, &w).unwrap().whole_lines();
        assert!(f.read(&w, b"1796119200.5 GET /a").is_ok());
        assert!(f.read(&w, b"1796119200.5 M-SEARCH /a").is_ok(), "a token");
        assert!(f.read(&w, b"1796119200.5 G(T /a").err().unwrap().contains("method"));
        // A Unix socket's peer has no address: the line cannot be keyed as the proxy keyed it.
        let f = Template::compile("u", "$remote_addr $msec $request_uri", Syntax::Nginx, &w).unwrap();
        assert!(f.read(&w, b"unix: 1796119200.5 /a").err().unwrap().contains("Unix socket"));
        assert_eq!(f.read(&w, b"- 1796119200.5 /a").unwrap().peer, None, "`-` is absent");
        let f =
            Template::compile("u", "%DOWNSTREAM_REMOTE_ADDRESS% %START_TIME% %REQ(:PATH)%", Syntax::Envoy, &w).unwrap();
        for unix in ["/run/envoy.sock", "@envoy", "unix:/run/envoy.sock"] {
            let line = format!("{unix} 2026-12-01T10:00:00Z /a");
            assert!(f.read(&w, line.as_bytes()).err().unwrap().contains("Unix socket"), "{unix}");
        }
        assert_eq!(f.read(&w, b"192.0.2.1:5123 2026-12-01T10:00:00Z /a").unwrap().peer.as_deref(), Some("192.0.2.1"));
        // The predefined formats leave what a log appends after their fields.
        let combined = Template::compile("c", NGINX_COMBINED, Syntax::Nginx, &w).unwrap();
        assert!(combined
            .read(&w, br#"1.2.3.4 - - [01/Dec/2026:10:00:00 +0000] "GET / HTTP/1.1" 200 0 "-" "-" 0.004"#)
            .is_ok());
    }

    #[test]
    fn a_format_strings_closing_newline_is_not_part_of_a_line() {
        let w = wanted();
        // Envoy's documented default format string, as its YAML writes it.
        let envoy = format!("{ENVOY_DEFAULT}\\n");
        let line = br#"[2026-12-01T10:00:00.250Z] "GET /x HTTP/2" 200 - 0 1 2 1 "198.51.100.1" "ua" "id" "host" "10.0.0.2:80""#;
        for text in [
            envoy.clone(),
            format!("{ENVOY_DEFAULT}\n"),
            format!("{ENVOY_DEFAULT}\r\n"),
            format!("{ENVOY_DEFAULT} \\n"),
        ] {
            let f = Template::compile("e", &text, Syntax::Envoy, &w).unwrap().whole_lines();
            let e = f.read(&w, line).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert_eq!((e.ts, &*e.path), (1_796_119_200_250_000_000, &b"/x"[..]), "{text:?}");
            assert!(f.read(&w, &[&line[..], b" "].concat()).is_ok(), "white space at a line's end is no field");
            assert!(f.read(&w, &[&line[..], b" x"].concat()).is_err(), "{text:?}");
        }
        let nginx = format!("{NGINX_COMBINED}\n");
        let f = Template::compile("n", &nginx, Syntax::Nginx, &w).unwrap().whole_lines();
        assert!(f.read(&w, br#"1.2.3.4 - - [01/Dec/2026:10:00:00 +0000] "GET / HTTP/1.1" 200 0 "-" "-""#).is_ok());
        // A format ending in a field reads it to the line's end, without the white space after.
        let f = Template::compile("u", "$msec $request_uri\n", Syntax::Nginx, &w).unwrap().whole_lines();
        assert_eq!(&*f.read(&w, b"1796119200.5 /a?b \r").unwrap().path, b"/a?b");
    }

    #[test]
    fn durations_are_read_in_their_formats_units() {
        let w = wanted();
        assert_eq!(duration(b"0.004", Unit::Seconds), Some(4_000_000));
        assert_eq!(duration(b"12", Unit::Millis), Some(12_000_000));
        assert_eq!(duration(b"12.5", Unit::Millis), Some(12_500_000));
        assert_eq!(duration(b"0", Unit::Millis), Some(0));
        for bad in [&b""[..], b"-1", b"1.", b".5", b"1.2.3", b"5ms", b"1e3"] {
            assert_eq!(duration(bad, Unit::Millis), None, "{}", String::from_utf8_lossy(bad));
        }
        // Envoy's default format: `%DURATION%` in milliseconds, after `%START_TIME%`, the start.
        let f = Template::compile("e", ENVOY_DEFAULT, Syntax::Envoy, &w).unwrap();
        let line = br#"[2026-12-01T10:00:00.250Z] "GET /x HTTP/2" 200 - 0 1 1500 1 "198.51.100.1" "ua" "id" "host" "10.0.0.2:80""#;
        let e = f.read(&w, line).unwrap();
        assert_eq!((e.ts, e.duration), (1_796_119_200_250_000_000, Some(1_500_000_000)));
        let no = br#"[2026-12-01T10:00:00.250Z] "GET /x HTTP/2" 200 - 0 1 - 1 "198.51.100.1" "ua" "id" "host" "10.0.0.2:80""#;
        assert_eq!(f.read(&w, no).unwrap().duration, None, "`-` is absent");
        let junk = br#"[2026-12-01T10:00:00.250Z] "GET /x HTTP/2" 200 - 0 1 x1 1 "198.51.100.1" "ua" "id" "host" "10.0.0.2:80""#;
        assert!(f.read(&w, junk).err().unwrap().contains("duration"));
        // NGINX writes its times when a request completes: it started `$request_time` before.
        let f = Template::compile("n", "$remote_addr $msec $request_time \"$request\"", Syntax::Nginx, &w).unwrap();
        let e = f.read(&w, br#"192.0.2.1 1796119200.500 1.250 "GET /a HTTP/1.1""#).unwrap();
        assert_eq!((e.ts, e.duration), (1_796_119_199_250_000_000, Some(1_250_000_000)));
        assert!(f.read(&w, br#"192.0.2.1 1796119200.500 slow "GET /a HTTP/1.1""#).is_err());
    }

    /// A message about a line names the field, where it starts and how long it is, never
    /// what the line holds there: with a space in a header's value, the value runs into the
    /// fields after it.
    #[test]
    fn no_message_about_a_line_quotes_it() {
        let w = wanted();
        let nginx =
            Template::compile("n", r#"$remote_addr $msec $request_method "$request" $request_time"#, Syntax::Nginx, &w)
                .unwrap()
                .whole_lines();
        for (line, says) in [
            (
                r#"sk_SECRET 1796119200.5 GET "GET /a HTTP/1.1" 0.1"#,
                "cannot read the client address at column 1 (9 bytes)",
            ),
            (
                r#"/sk_SECRET 1796119200.5 GET "GET /a HTTP/1.1" 0.1"#,
                "client address at column 1 (10 bytes) is a Unix socket's",
            ),
            (r#"192.0.2.1 sk_SECRET GET "GET /a HTTP/1.1" 0.1"#, "cannot read the time at column 11 (9 bytes)"),
            (
                r#"192.0.2.1 1796119200.5 sk/SECRET "GET /a HTTP/1.1" 0.1"#,
                "cannot read the method at column 24 (9 bytes)",
            ),
            (r#"192.0.2.1 1796119200.5 GET "sk_SECRET" 0.1"#, "cannot read the request line at column 29 (9 bytes)"),
            (
                r#"192.0.2.1 1796119200.5 GET "GET /a HTTP/1.1" Bearer sk_SECRET"#,
                "cannot read the duration at column 46 (16 bytes)",
            ),
        ] {
            let e = nginx.read(&w, line.as_bytes()).err().unwrap_or_else(|| panic!("{line}"));
            assert!(e.contains(says) && !e.contains("SECRET"), "{line}: {e}");
        }
        let envoy = Template::compile("e", "%START_TIME(%s)% %REQ(:PATH)% %DURATION%", Syntax::Envoy, &w).unwrap();
        for (line, says) in [
            ("sk_SECRET /a 1", "cannot read the time at column 1 as %s writes it"),
            ("1796119200 - 1", "cannot read the path at column 12 (1 byte)"),
        ] {
            let e = envoy.read(&w, line.as_bytes()).err().unwrap_or_else(|| panic!("{line}"));
            assert!(e.contains(says) && !e.contains("SECRET"), "{line}: {e}");
        }
    }

    /// A value with a space, unquoted in the format, cannot be told from a line with more
    /// fields than the format: such a line is unreadable, never split at the space (a token
    /// cut there keys the request wrongly, and its rest would show as another dimension's).
    #[test]
    fn a_line_an_unquoted_value_may_have_run_into_is_unreadable() {
        let w = Wanted::new(vec!["x-user-id".to_owned(), "authorization".to_owned()]);
        let nginx = r#"203.0.113.1 [01/Dec/2026:10:00:00 +0000] "GET /v1/a HTTP/1.1" Bearer eyJhbGciOiJTOPSECRET"#;
        let envoy = r#"[2026-12-01T10:00:00.000Z] 1.2.3.4:1 "GET /v1/a HTTP/1.1" Bearer eyJhbGciOiJTOPSECRET"#;
        let envoy_format = r#"[%START_TIME%] %DOWNSTREAM_REMOTE_ADDRESS% "%REQ(:METHOD)% %REQ(:PATH)% %PROTOCOL%""#;
        for (format, syntax, line, says) in [
            (
                r#"$remote_addr [$time_local] "$request" $http_authorization $http_x_user_id"#.to_owned(),
                Syntax::Nginx,
                format!("{nginx} alice"),
                "the x-user-id header at column 70 (26 bytes) holds the text that separates it from the field before it",
            ),
            (
                r#"$remote_addr [$time_local] "$request" $http_authorization $http_x_user_id;"#.to_owned(),
                Syntax::Nginx,
                format!("{nginx} alice;"),
                "the x-user-id header at column 70 (26 bytes) holds the text that separates",
            ),
            (
                r#"$remote_addr [$time_local] "$request" $http_authorization"#.to_owned(),
                Syntax::Nginx,
                nginx.to_owned(),
                "the authorization header at column 63 (27 bytes) holds a space, last on the line after a space",
            ),
            (
                format!("{envoy_format} %REQ(AUTHORIZATION)% %REQ(X-USER-ID)%"),
                Syntax::Envoy,
                format!("{envoy} alice"),
                "the x-user-id header at column 66 (26 bytes) holds the text that separates",
            ),
        ] {
            let f = Template::compile("f", &format, syntax, &w).unwrap();
            for f in [Template::compile("f", &format, syntax, &w).unwrap().whole_lines(), f] {
                let e = f.read(&w, line.as_bytes()).err().unwrap_or_else(|| panic!("{format}"));
                assert!(e.contains(says) && !e.contains("SECRET"), "{format}: {e}");
            }
        }
        // A format of one's own reads its fields to the end of the line, skipped ones too.
        let f = Template::compile(
            "s",
            r#"$remote_addr [$time_local] "$request" $http_authorization $status "$http_user_agent""#,
            Syntax::Nginx,
            &w,
        )
        .unwrap()
        .whole_lines();
        let e = f.read(&w, format!(r#"{nginx} 200 "ua""#).as_bytes()).err().unwrap();
        assert!(e.contains("the field at column 70 (24 bytes) holds the text that separates"), "{e}");
        // Quoted, the same values are read whole; unquoted values without a space read as ever.
        let f = Template::compile(
            "q",
            r#"$remote_addr [$time_local] "$request" "$http_authorization" $http_x_user_id"#,
            Syntax::Nginx,
            &w,
        )
        .unwrap()
        .whole_lines();
        let line = r#"203.0.113.1 [01/Dec/2026:10:00:00 +0000] "GET /v1/a HTTP/1.1" "Bearer eyJ" alice"#;
        let e = f.read(&w, line.as_bytes()).unwrap();
        assert_eq!((e.headers[0].as_deref(), e.headers[1].as_deref()), (Some(&b"alice"[..]), Some(&b"Bearer eyJ"[..])));
        let f =
            Template::compile("u", &format!("{envoy_format} %REQ(AUTHORIZATION)% %REQ(X-USER-ID)%"), Syntax::Envoy, &w)
                .unwrap()
                .whole_lines();
        let line = r#"[2026-12-01T10:00:00.000Z] 1.2.3.4:1 "GET /v1/a HTTP/1.1" tok alice"#;
        let e = f.read(&w, line.as_bytes()).unwrap();
        assert_eq!((e.headers[0].as_deref(), e.headers[1].as_deref()), (Some(&b"alice"[..]), Some(&b"tok"[..])));
    }

    /// `%START_TIME(…)%` reads a line's time by its format, which says where the time ends:
    /// spaces and all.
    #[test]
    fn start_time_formats_read_the_time_as_they_write_it() {
        let w = wanted();
        // 2026-12-01T10:00:00Z, a Tuesday, the 335th day of the year.
        let t = 1_796_119_200_000_000_000;
        for (format, written, want) in [
            ("%Y/%m/%dT%H:%M:%S%z", "2026/12/01T11:00:00+0100", t),
            ("%d/%b/%Y:%H:%M:%S %z", "01/Dec/2026:05:00:00 -0500", t),
            ("%Y-%m-%d %H:%M:%S", "2026-12-01 10:00:00", t),
            ("%F %T.%f", "2026-12-01 10:00:00.250000000", t + 250_000_000),
            ("%Y-%m-%dT%H:%M:%S.%3fZ", "2026-12-01T10:00:00.007Z", t + 7_000_000),
            ("%s.%3f", "1796119200.250", t + 250_000_000),
            ("%s.%6f", "1796119200.000250", t + 250_000),
            ("%s.%9f", "1796119200.000000250", t + 250),
            ("%s.%1f", "1796119200.2", t + 200_000_000),
            ("%s", "1796119200", t),
            ("%s%3f", "1796119200250", t + 250_000_000),
            ("%s%6f", "1796119200000250", t + 250_000),
            ("%Y%j %H%M", "2026335 1000", t),
            ("%a, %e %B %Y %H:%M:%S.%2f", "Tue,  1 December 2026 10:00:00.25", t + 250_000_000),
            ("%Y-%m-%d %H:%M:%S 100%%", "2026-12-01 10:00:00 100%", t),
        ] {
            let text = format!("%START_TIME({format})% %REQ(:PATH)% %DOWNSTREAM_REMOTE_ADDRESS%");
            let f = Template::compile("e", &text, Syntax::Envoy, &w).unwrap().whole_lines();
            let line = format!("{written} /a 192.0.2.1:5123");
            let e = f.read(&w, line.as_bytes()).unwrap_or_else(|e| panic!("{format}: {e}"));
            assert_eq!((e.ts, &*e.path, e.peer.as_deref()), (want, &b"/a"[..], Some("192.0.2.1")), "{format}");
        }
        // A time not as its format writes it is unreadable.
        for (format, written) in [
            ("%d/%b/%Y:%H:%M:%S %z", "31/Feb/2026:10:00:00 +0000"),
            ("%d/%b/%Y:%H:%M:%S %z", "01/Dec/2026:10:00:00"),
            ("%s.%3f", "1796119200.25"),
            ("%s%3f", "250"),
            ("%a %F %T", "Mon 2026-12-01 10:00:00"),
            ("%F %T", "2026-12-01T10:00:00"),
            ("%F %T", "1969-12-31 23:59:59"),
        ] {
            let text = format!("%START_TIME({format})% %REQ(:PATH)%");
            let f = Template::compile("e", &text, Syntax::Envoy, &w).unwrap().whole_lines();
            let e = f.read(&w, format!("{written} /a").as_bytes()).err().unwrap_or_else(|| panic!("{written}"));
            assert!(e.contains("cannot read the time at column 1"), "{written}: {e}");
        }
        // A specifier it cannot read, or a format without an instant, is refused at once.
        for (format, why) in [
            ("%F %H:%M:%Q", "%Q is not a time specifier"),
            ("%Ez", "%E is not a time specifier"),
            ("%s %", "names no specifier"),
            ("%H:%M:%S", "gives no instant"),
            ("%F", "gives no instant"),
            ("%m/%d %H:%M", "gives no instant"),
        ] {
            let text = format!("%START_TIME({format})% %REQ(:PATH)%");
            let e = Template::compile("e", &text, Syntax::Envoy, &w).err().unwrap_or_else(|| panic!("{format}"));
            assert!(e.starts_with(&format!("%START_TIME({format})%: ")) && e.contains(why), "{format}: {e}");
        }
    }

    #[test]
    fn addresses_lose_their_ports() {
        for (raw, want) in [
            ("192.0.2.1:443", "192.0.2.1"),
            ("[2001:db8::1]:443", "2001:db8::1"),
            ("2001:db8::1", "2001:db8::1"),
            ("192.0.2.1", "192.0.2.1"),
        ] {
            assert_eq!(without_port(raw.as_bytes()), Some(want), "{raw}");
        }
    }
}
