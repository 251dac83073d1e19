//! `ratewall`: the operator tool for rules documents (docs/rules.md; docs/cli.md).
//!
//! - `ratewall check RULES.json`: validate; each rule's match, key, algorithm, limits, plans.
//!   `ratewall check FILE.yaml` (or a directory of them) validates envoyproxy/ratelimit's
//!   configuration for `ratewall-store --rls-config` instead: each domain's limits (a
//!   `.yaml` file that holds a JSON object with `rules` is a rules document all the same).
//! - `ratewall explain RULES.json --method M --path P [-H 'name: value']... [--ip A]`: which
//!   rules match a request, the counter key each would use, the limit in force (and whose plan
//!   it is), and why the others do not.
//! - `ratewall replay RULES.json LOG [--format nginx|envoy|jsonl|auto] [--log-format '…']`:
//!   an access log (NGINX `main`, `combined` or any `log_format`, Envoy's default format or
//!   any format string, ratewall's JSON lines) through the core on its own clock (no sleeping): per rule
//!   allowed / rejected / unkeyed, the top rejected keys. The offline twin of shadow mode.
//! - `ratewall schema`: the rules document's JSON Schema (`rules.schema.json`).
//!
//! Human-readable output by default, `--json` for scripts. Exit codes: 0 done (a valid
//! document; a replay that ran, its unreadable log lines reported on stderr), 1 a document
//! that is not valid (`path: reason` lines on stderr), 2 a usage error, a file that cannot
//! be read, or output that cannot be written.

// `serde_json::Value` is read with `v["field"]`, which gives `Null` for a missing field (it
// never panics); nothing else here indexes.
#![allow(clippy::indexing_slicing)]

/// `println!`, but it ends the program quietly once standard output is closed (`ratewall
/// replay … | head`) instead of panicking, and with exit code 2 when the output cannot be
/// written (a full disk): never a success with the output lost.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($t)*) {
            $crate::unwritable(&e);
        }
    }};
}

/// `eprintln!`, but a message that cannot be written is dropped rather than a panic.
macro_rules! tell {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($t)*);
    }};
}

mod describe;
mod explain;
mod logformat;
mod replay;
mod schema;

/// mimalloc rather than the system allocator: `replay` allocates a few small buffers per log
/// line on one thread and frees them on another, where glibc's malloc spent ~30 % of the
/// run (perf, 1,000,000 lines); measured in `cargo bench -p ratewall-cli` (BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, Subcommand};
use ratewall_core::rules::MAX_DOCUMENT;
use ratewall_core::Config;
use ratewall_store::rls::config::RlsConfig;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "ratewall", version, about = "Check, explain and replay ratewall rules documents")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a rules document (or a rate limit service configuration: a `.yaml` file or a
    /// directory of them) and print its rules.
    Check {
        /// The rules document ("-": standard input), or the `.yaml` file or directory of a
        /// rate limit service configuration.
        rules: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Show which rules a request matches, the counter key and limit of each, and why the
    /// other rules do not apply.
    Explain {
        /// The rules document ("-": standard input).
        rules: PathBuf,
        /// The request's method.
        #[arg(long, default_value = "GET")]
        method: String,
        /// The request's path (with its query, if any).
        #[arg(long)]
        path: String,
        /// A request header, `name: value` (repeatable).
        #[arg(short = 'H', long = "header")]
        headers: Vec<String>,
        /// The address the proxy sees the request from (the peer).
        #[arg(long)]
        ip: Option<String>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Replay an access log through the rules on the log's own clock: NGINX (`main`, `combined`
    /// or a `log_format`), Envoy (its default format or a format string), or JSON lines
    /// ({"ts", "method", "path", "headers", "ip", "duration_ms"}).
    Replay {
        /// The rules document ("-": standard input, when the log is a file).
        rules: PathBuf,
        /// The log ("-": standard input).
        log: PathBuf,
        /// How the log is written; `auto` tells the formats apart from its first lines.
        #[arg(long, value_enum, default_value_t = replay::FormatChoice::Auto)]
        format: replay::FormatChoice,
        /// The format string the log was written with: an NGINX `log_format` (`$remote_addr`,
        /// `$time_local`, `$request`, `$http_x_api_key`, ...) or an Envoy format string
        /// (`%START_TIME%`, `%REQ(X-API-KEY)%`, ...).
        #[arg(long)]
        log_format: Option<String>,
        /// How many of the most rejected keys to list per rule.
        #[arg(long, default_value_t = 10)]
        top: usize,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print the JSON Schema (2020-12) of the rules document.
    Schema,
}

/// How a command ended badly.
pub enum Failure {
    /// The input is not valid (exit 1): its `path: reason` lines.
    Invalid(Vec<String>),
    /// Usage or I/O (exit 2).
    Usage(String),
}

/// Reads and parses a rules document: its text (for what the parser does not keep, such as
/// the patterns as written) and the validated rules.
pub fn load(path: &Path) -> Result<(serde_json::Value, Config), Failure> {
    if is_rls_config(path) {
        // Told "not valid JSON" at its first byte, a user could not see what was wrong.
        return Err(Failure::Invalid(vec![format!(
            "(document): {} reads as a rate limit service configuration (a directory, or YAML \
             that is not a JSON rules document): `explain` and `replay` read a rules document; \
             `ratewall check` validates a rate limit service configuration",
            path.display()
        )]));
    }
    let bytes = read_document(path)?;
    let mut config = Config::parse(&bytes).map_err(|e| Failure::Invalid(problems(&bytes, e)))?;
    config.identity.key_by_secret(&deployment_secret());
    // The core accepted it, so it is JSON (after a byte order mark, which the core skips too).
    let doc = serde_json::from_slice(without_bom(&bytes)).unwrap_or(serde_json::Value::Null);
    Ok((doc, config))
}

/// A bad document's `path: reason` lines: the parser's first, then those of each other rule
/// that is bad on its own (each checked in a copy of the document holding it alone), so that
/// one run names every bad rule, not only the first. A copy is the document with what it
/// leaves out made blank, so what is left keeps its line and column: a fault found in a copy
/// is said where it is in the file.
fn problems(bytes: &[u8], first: ratewall_core::rules::ConfigError) -> Vec<String> {
    let line = |e: &ratewall_core::rules::ConfigError| {
        let at = if e.path.is_empty() { "(document)".to_owned() } else { e.path.clone() };
        format!("{at}: {}", e.reason)
    };
    let mut lines = vec![line(&first)];
    let text = without_bom(bytes);
    use serde_json::value::RawValue;
    let Ok(Members(doc)) = serde_json::from_slice::<Members<'_>>(text) else { return lines };
    let named = |name: &str| doc.iter().rev().find(|(k, _)| k == name).map(|(_, v)| *v);
    let Some(Ok(rules)) = named("rules").map(|r| serde_json::from_str::<Vec<&RawValue>>(r.get())) else {
        return lines;
    };
    let Some(rules) = rules.iter().map(|r| span(text, r)).collect::<Option<Vec<_>>>() else { return lines };
    // The rules array's elements, from the first one's start to the last one's end, but for
    // those of `keep`.
    let all_rules = |keep: Option<usize>| -> Vec<std::ops::Range<usize>> {
        let (Some(first), Some(last)) = (rules.first(), rules.last()) else { return Vec::new() };
        match keep.and_then(|k| rules.get(k)) {
            Some(kept) => vec![first.start..kept.start, kept.end..last.end],
            None => std::iter::once(first.start..last.end).collect(),
        }
    };
    // The document's members in order, and the commas between them.
    let Some(mut members) =
        doc.iter().map(|(k, v)| Some((member_span(text, v)?, k.as_str()))).collect::<Option<Vec<_>>>()
    else {
        return lines;
    };
    members.sort_by_key(|(m, _)| m.start);
    // What leaves the members named out: them, and commas so that one parts each two left.
    let without = |out: &[String]| -> Vec<std::ops::Range<usize>> {
        let mut gone = Vec::new();
        let mut last_kept: Option<usize> = None;
        for (j, (m, name)) in members.iter().enumerate() {
            if out.iter().any(|o| o == name) {
                gone.push(m.clone());
                continue;
            }
            // Between the last member kept and this one, the comma after the former stays;
            // before the first one kept, none.
            match last_kept {
                Some(p) => gone.push(members.get(p + 1).map_or(m.start, |(n, _)| n.start)..m.start),
                None => gone.push(members.first().map_or(m.start, |(n, _)| n.start)..m.start),
            }
            last_kept = Some(j);
        }
        // Past the last member kept: no comma.
        if let (Some(p), Some((last, _))) = (last_kept, members.last()) {
            if let Some((after, _)) = members.get(p) {
                gone.push(after.end..last.end);
            }
        }
        gone
    };
    // The document's other members without its rules: a fault of one of them (an unknown
    // member, a bad `response` or `sync`) is said, and the member left out, so that the rules
    // are each judged alone all the same. Not `identity`: a rule is judged by the dimensions
    // it names, so with a bad identity none can be.
    let mut left_out: Vec<std::ops::Range<usize>> = Vec::new();
    let mut out: Vec<String> = Vec::new();
    for _ in 0..doc.len() {
        let mut gone = all_rules(None);
        gone.extend(left_out.iter().cloned());
        let Err(e) = Config::parse(&blanked(text, &gone)) else { break };
        let member = e.path.split(['.', '[']).next().unwrap_or_default().to_owned();
        let found = line(&e);
        if !lines.contains(&found) {
            lines.push(found);
        }
        if member.is_empty() || member == "identity" || member == "rules" {
            return lines;
        }
        if out.contains(&member) || named(&member).is_none() {
            return lines;
        }
        out.push(member);
        left_out = without(&out);
    }
    // The first fault's rule is said already.
    let said = first.path.strip_prefix("rules[").and_then(|r| r.split(']').next()).and_then(|i| i.parse().ok());
    for i in (0..rules.len()).filter(|i| Some(*i) != said) {
        let mut gone = all_rules(Some(i));
        gone.extend(left_out.iter().cloned());
        let Err(e) = Config::parse(&blanked(text, &gone)) else { continue };
        // Only what is this rule's own (the rest of the document is as in the first line).
        let Some(rest) = e.path.strip_prefix("rules[0]") else { continue };
        let found = line(&ratewall_core::rules::ConfigError { path: format!("rules[{i}]{rest}"), ..e });
        if !lines.contains(&found) {
            lines.push(found);
        }
    }
    lines
}

/// A JSON object's members in order, each of a name given twice kept (a map keeps one).
struct Members<'a>(Vec<(String, &'a serde_json::value::RawValue)>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for Members<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct InOrder<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for InOrder<'a> {
            type Value = Members<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(self, mut map: M) -> Result<Members<'a>, M::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(InOrder(std::marker::PhantomData))
    }
}

/// Where `raw`, read from `text`, is in it.
fn span(text: &[u8], raw: &serde_json::value::RawValue) -> Option<std::ops::Range<usize>> {
    let start = (raw.get().as_ptr() as usize).checked_sub(text.as_ptr() as usize)?;
    let end = start.checked_add(raw.get().len())?;
    (end <= text.len()).then_some(start..end)
}

/// Where a member whose value is `value` is in `text`: from its key's opening quote to its
/// value's end.
fn member_span(text: &[u8], value: &serde_json::value::RawValue) -> Option<std::ops::Range<usize>> {
    let at = |i: usize| text.get(i).copied();
    let value = span(text, value)?;
    let skip_back = |mut i: usize| {
        while i > 0 && at(i - 1).is_some_and(|b| b.is_ascii_whitespace()) {
            i -= 1;
        }
        i
    };
    // Back over `: ` to the key's closing quote, then to its opening one (a quote after an
    // even run of backslashes).
    let colon = skip_back(value.start).checked_sub(1)?;
    let close = skip_back(colon).checked_sub(1)?;
    if at(colon) != Some(b':') || at(close) != Some(b'"') {
        return None;
    }
    let mut open = close;
    loop {
        open = open.checked_sub(1)?;
        let slashes = text.get(..open)?.iter().rev().take_while(|b| **b == b'\\').count();
        if at(open) == Some(b'"') && slashes % 2 == 0 {
            break;
        }
    }
    Some(open..value.end)
}

/// `text` with the bytes of `gone` made spaces, its line breaks kept.
fn blanked(text: &[u8], gone: &[std::ops::Range<usize>]) -> Vec<u8> {
    let mut out = text.to_vec();
    for r in gone {
        for b in out.get_mut(r.clone()).into_iter().flatten() {
            if *b != b'\n' && *b != b'\r' {
                *b = b' ';
            }
        }
    }
    out
}

/// Reads a rules document: at most the parser's limit ([`MAX_DOCUMENT`] bytes), never more
/// of what `path` names, so a path to an endless file (`/dev/zero`, a pipe) ends in the same
/// "too large" error as a large file rather than in memory growing without bound.
/// `-` is standard input (`kubectl get configmap … | ratewall check -`).
fn read_document(path: &Path) -> Result<Vec<u8>, Failure> {
    let name = if is_stdin(path) { "standard input".to_owned() } else { path.display().to_string() };
    let cannot = |e: std::io::Error| Failure::Usage(format!("cannot read {name}: {e}"));
    let (bytes, size) = if is_stdin(path) {
        (read_at_most(std::io::stdin().lock(), MAX_DOCUMENT).map_err(cannot)?, None)
    } else {
        let file = std::fs::File::open(path).map_err(cannot)?;
        let bytes = read_at_most(&file, MAX_DOCUMENT).map_err(cannot)?;
        // A file says its size; what does not (a device, a pipe) is at least one byte over.
        (bytes, file.metadata().ok().filter(std::fs::Metadata::is_file).map(|m| m.len()))
    };
    if bytes.len() <= MAX_DOCUMENT {
        return Ok(bytes);
    }
    let has = size.map_or_else(|| format!("more than {MAX_DOCUMENT}"), |n| n.to_string());
    Err(Failure::Invalid(vec![format!("(document): has {has} bytes; at most {MAX_DOCUMENT} are accepted")]))
}

/// The first `limit` bytes of `r`, and one more when there are more: never all of an endless
/// input.
fn read_at_most(r: impl std::io::Read, limit: usize) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;
    let mut bytes = Vec::new();
    r.take(u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1)).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// The secret a Worker deployment keys its hashes by when its rules set neither
/// `identity.hash_key` nor `sync` — `RATEWALL_SYNC_SECRET`, else `RATEWALL_ADMIN_TOKEN` — read
/// from the same environment variables, so `explain` and `replay` show a secret value under
/// that deployment's `#hash`. Empty when neither is set.
fn deployment_secret() -> String {
    ["RATEWALL_SYNC_SECRET", "RATEWALL_ADMIN_TOKEN"]
        .iter()
        .find_map(|name| std::env::var(name).ok().map(|v| v.trim().to_owned()).filter(|v| !v.is_empty()))
        .unwrap_or_default()
}

/// Whether `path` is envoyproxy/ratelimit's YAML (a directory, or a `.yaml` / `.yml` file)
/// rather than a rules document. A `.yaml` file that holds a JSON object with `rules` is a
/// rules document (JSON is YAML too): its content decides, not its name.
fn is_rls_config(path: &Path) -> bool {
    // Standard input is read once, as a rules document.
    if is_stdin(path) {
        return false;
    }
    if path.is_dir() {
        return true;
    }
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if !ext.eq_ignore_ascii_case("yaml") && !ext.eq_ignore_ascii_case("yml") {
        // Under another name (a ConfigMap's key, `ratelimit.conf`), the service reads it all
        // the same: a file that is no JSON and has a top-level `domain:` is its YAML. Only a
        // regular file is read for it: a pipe (`<(kubectl ...)`) read here is empty after.
        // Its first MiB tells, whatever its size (the service reads up to 16 MiB of YAML).
        return path.metadata().is_ok_and(|m| m.is_file())
            && std::fs::File::open(path)
                .and_then(|f| read_at_most(f, MAX_DOCUMENT))
                .is_ok_and(|bytes| looks_like_rls_yaml(&bytes));
    }
    !read_document(path).is_ok_and(|bytes| is_rules_document(&bytes))
}

/// Whether `bytes` (a file's, or its beginning) are no JSON and have a line that starts with
/// `domain:`, the top-level key of envoyproxy/ratelimit's YAML.
fn looks_like_rls_yaml(bytes: &[u8]) -> bool {
    let bytes = without_bom(bytes);
    serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_err()
        && bytes.split(|b| *b == b'\n').any(|line| line.starts_with(b"domain:"))
}

/// Whether `path` names standard input (`-`).
pub fn is_stdin(path: &Path) -> bool {
    path.as_os_str() == "-"
}

/// Whether `bytes` are a JSON object with a `rules` member: a rules document, valid or not,
/// never a rate limit service configuration (whose top level has `domain` and `descriptors`).
fn is_rules_document(bytes: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(without_bom(bytes)).is_ok_and(|v| v.get("rules").is_some())
}

/// `bytes` past a UTF-8 byte order mark, if they begin with one (an editor's, on Windows):
/// the core reads such a document, and so must what shows it (its patterns as written).
fn without_bom(bytes: &[u8]) -> &[u8] {
    bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(bytes)
}

/// `ratewall check` of a rate limit service configuration: its limits, or `file:line:column:
/// reason`.
fn check_rls(path: &Path, as_json: bool) -> Result<(), Failure> {
    if !path.exists() {
        return Err(Failure::Usage(format!("cannot read {}: no such file or directory", path.display())));
    }
    // A file that cannot be read is the operator's to fix (exit 2), not an invalid document.
    if let Ok(files) = ratewall_store::rls::config::files(path) {
        for file in files {
            if let Err(e) = std::fs::File::open(&file) {
                return Err(Failure::Usage(format!("cannot read {}: {e}", file.display())));
            }
        }
    }
    let secret = deployment_secret();
    let shown_by = ratewall_core::key::HashKey::derive(secret.as_bytes());
    // A secret value written in the file is shown by its hash under the deployment's key: without
    // it here, under the built-in one, which anyone can hash guesses with (as `check` says of a
    // rules document's).
    let built_in = |shown: &str| {
        if secret.is_empty() && shown.contains('#') {
            tell!(
                "note: secret values are shown as #hash under ratewall's built-in key, which anyone can hash guesses with; set RATEWALL_SYNC_SECRET to the store's to see them as it names them"
            );
        }
    };
    let config = match RlsConfig::load_keyed(path, Some(shown_by)) {
        Ok(c) => c,
        Err(mut e) => {
            built_in(&e.reason);
            // A rules document among a directory's files: the service would refuse it as this
            // says, and the operator meant it for the filter.
            if path.is_dir() && read_document(Path::new(&e.file)).is_ok_and(|b| is_rules_document(&b)) {
                e.reason.push_str(&format!(
                    " ({} is a rules document, which `ratewall-store --rls-config` cannot read: move it out of {}, and check it on its own with `ratewall check {}`)",
                    e.file,
                    path.display(),
                    e.file
                ));
            }
            if as_json {
                say!(
                    "{}",
                    serde_json::json!({"valid": false, "errors": [{"file": e.file, "line": e.line, "column": e.column, "reason": e.reason}]})
                );
            }
            return Err(Failure::Invalid(vec![e.to_string()]));
        }
    };
    // What the service would skip with a warning (a known key where it is not read, such as
    // `shadow_mode` inside a `rate_limit`) is what a check is for: shown, though not fatal.
    for w in &config.warnings {
        tell!("warning: {w}");
    }
    let limit = |r: &ratewall_store::rls::config::Rule| -> (String, String) {
        let algorithm = r.limit.map_or("fixed_window", |l| l.algorithm().as_str()).to_owned();
        let text = match r.unit {
            _ if r.unlimited => "unlimited".to_owned(),
            Some(u) => format!("{} per {}", r.requests_per_unit, u.proto_name().to_ascii_lowercase()),
            None => "none".to_owned(),
        };
        (text, algorithm)
    };
    if as_json {
        let rules: Vec<serde_json::Value> = config
            .rules
            .iter()
            .map(|r| {
                let (text, algorithm) = limit(r);
                serde_json::json!({"domain": r.domain, "key": r.full_key, "name": r.name, "limit": text,
                    "algorithm": algorithm, "shadow_mode": r.shadow, "quota_mode": r.quota, "exact": r.exact,
                    "replaces": r.replaces})
            })
            .collect();
        let warnings: Vec<serde_json::Value> = config
            .warnings
            .iter()
            .map(|w| serde_json::json!({"file": w.file, "line": w.line, "column": w.column, "reason": w.reason}))
            .collect();
        say!(
            "{}",
            serde_json::json!({"valid": true, "domains": config.domains().collect::<Vec<_>>(), "rules": rules, "warnings": warnings})
        );
        return Ok(());
    }
    let domains: Vec<&str> = config.domains().collect();
    say!(
        "{}: valid rate limit service configuration, {} domain{} ({}), {} limit{}",
        path.display(),
        domains.len(),
        if domains.len() == 1 { "" } else { "s" },
        domains.join(", "),
        config.rules.len(),
        if config.rules.len() == 1 { "" } else { "s" }
    );
    for r in &config.rules {
        let (text, algorithm) = limit(r);
        let mut flags = Vec::new();
        if !r.unlimited {
            flags.push(algorithm);
        }
        if r.shadow {
            flags.push("shadow_mode".to_owned());
        }
        if r.quota {
            flags.push("quota_mode".to_owned());
        }
        if r.exact {
            flags.push("exact".to_owned());
        }
        if !r.replaces.is_empty() {
            flags.push(format!("replaces {}", r.replaces.join(", ")));
        }
        let name = if r.name.is_empty() { String::new() } else { format!(" ({})", r.name) };
        let flags = if flags.is_empty() { String::new() } else { format!("; {}", flags.join("; ")) };
        say!("- {}{name}: {text}{flags}", r.full_key);
    }
    built_in(&config.rules.iter().map(|r| r.full_key.as_str()).collect::<String>());
    Ok(())
}

/// Ends the program once standard output cannot be written: quietly (exit 0) when its reader
/// has gone (`| head`), else with the reason and exit code 2.
fn unwritable(e: &std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    tell!("ratewall: cannot write the output: {e}");
    std::process::exit(2);
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    let result = match cli.command {
        Command::Check { rules, json } if is_rls_config(&rules) => check_rls(&rules, json),
        Command::Check { rules, json } => describe::check(&rules, json),
        Command::Explain { rules, method, path, headers, ip, json } => {
            explain::explain(&rules, &method, &path, &headers, ip.as_deref(), json)
        }
        Command::Replay { rules, log, format, log_format, top, json } => replay::replay(&replay::Options {
            rules: &rules,
            log: &log,
            format,
            log_format: log_format.as_deref(),
            top,
            json,
        }),
        Command::Schema => {
            say!("{}", schema::text());
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Invalid(lines)) => {
            for l in lines {
                tell!("{l}");
            }
            ExitCode::from(1)
        }
        Err(Failure::Usage(why)) => {
            tell!("ratewall: {why}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn an_endless_input_is_read_only_to_one_byte_past_the_limit() {
        assert_eq!(read_at_most(std::io::repeat(b'x'), 1000).unwrap().len(), 1001);
        assert_eq!(read_at_most(&b"short"[..], 1000).unwrap(), b"short");
        assert_eq!(read_at_most(&[b'x'; 1000][..], 1000).unwrap().len(), 1000, "the limit itself is accepted");
    }

    #[test]
    fn a_rules_document_is_told_from_a_rate_limit_service_configuration_by_its_content() {
        assert!(is_rules_document(br#"{"$schema": "./rules.schema.json", "rules": []}"#));
        assert!(is_rules_document(br#"{"rules": 5}"#), "a bad rules document is still one, for its errors");
        assert!(!is_rules_document(br#"{"domain": "d", "descriptors": []}"#), "JSON is YAML too");
        assert!(!is_rules_document(b"domain: d\ndescriptors: []\n"));
        assert!(!is_rules_document(b"[]"));
    }
}
