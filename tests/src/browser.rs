//! A real browser for tests: Debian's headless Chromium (`/usr/bin/chromium`; `cargo xtask
//! test` installs it) driven by `playwright-core` from npm (pinned in package-lock.json; it
//! never downloads a browser of its own), in a fresh profile per page. It reports what a
//! person would see go wrong: console errors, uncaught exceptions, requests and failed
//! requests, and saves screenshots.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository's root (where `node_modules/` is).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Chromium the tests drive: `RATEWALL_CHROMIUM`, else Debian's.
pub fn chromium_path() -> PathBuf {
    std::env::var_os("RATEWALL_CHROMIUM").map_or_else(|| PathBuf::from("/usr/bin/chromium"), PathBuf::from)
}

/// Why a browser test cannot run here (no Chromium, no Node.js, no playwright-core), or `None`.
pub fn unavailable() -> Option<String> {
    if !chromium_path().exists() {
        return Some(format!(
            "no Chromium at {} (apt-get install chromium, or run `cargo xtask test`)",
            chromium_path().display()
        ));
    }
    if !root().join("node_modules/playwright-core/package.json").exists() {
        return Some("no node_modules/playwright-core (npm ci, or run `cargo xtask test`)".to_owned());
    }
    match Command::new("node").arg("--version").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("no Node.js".to_owned()),
    }
}

/// What to do with a page.
pub struct Visit<'a> {
    /// The page's address.
    pub url: &'a str,
    /// A JavaScript expression, evaluated in the page until it is truthy (the page is ready).
    pub until: &'a str,
    /// How long to wait for `until`, in milliseconds.
    pub timeout_ms: u64,
    /// A JavaScript expression evaluated once ready; its JSON value is [`Seen::result`].
    pub collect: &'a str,
    /// Screenshots to save once ready: (path, viewport width, viewport height), full page.
    pub screenshots: &'a [(&'a Path, u32, u32)],
}

/// What the browser saw.
#[derive(Debug)]
pub struct Seen {
    /// Console messages of type `error`, and uncaught exceptions.
    pub errors: Vec<String>,
    /// Every request the page made (its own address first), in order.
    pub requests: Vec<String>,
    /// Requests that failed (with the reason).
    pub failed: Vec<String>,
    /// The value of [`Visit::collect`].
    pub result: serde_json::Value,
    /// Per screenshot, its viewport width and the page's `.scroll` boxes whose content is wider
    /// than they are (named by their card's `data-rule` or `id`): what a reader there scrolls
    /// sideways to see.
    pub scrolling: Vec<(u64, Vec<String>)>,
}

impl Seen {
    /// Requests to anywhere but `origin` (`http://host:port`); `data:` URLs are the page's own.
    pub fn outside(&self, origin: &str) -> Vec<String> {
        let own = format!("{}/", origin.trim_end_matches('/'));
        self.requests.iter().filter(|u| !u.starts_with(&own) && !u.starts_with("data:")).cloned().collect()
    }
}

/// The driver: one persistent context in a fresh profile, the flags that keep Chromium from
/// calling home, every event recorded, and one JSON line of results on stdout.
const DRIVER: &str = r#"
const { chromium } = require('playwright-core');
const job = JSON.parse(process.env.RATEWALL_BROWSER_JOB);
(async () => {
  const out = { errors: [], requests: [], failed: [], result: null, scrolling: [] };
  const context = await chromium.launchPersistentContext(job.profile, {
    executablePath: job.chromium,
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
           '--disable-component-update', '--disable-sync'],
    viewport: { width: 1280, height: 900 },
  });
  try {
    context.on('request', r => out.requests.push(r.url()));
    context.on('requestfailed', r => out.failed.push(r.url() + ' ' + (r.failure() ? r.failure().errorText : '')));
    const page = context.pages()[0] || await context.newPage();
    page.on('console', m => { if (m.type() === 'error') out.errors.push(m.text()); });
    page.on('pageerror', e => out.errors.push('uncaught: ' + (e && e.message ? e.message : String(e))));
    await page.goto(job.url, { waitUntil: 'load' });
    try {
      // A function, not a string: Playwright polls a string with the page's `eval`, which the
      // page's Content-Security-Policy refuses.
      const until = new Function('return (' + job.until + ');');
      await page.waitForFunction(until, null, { timeout: job.timeout_ms, polling: 200 });
    } catch (e) {
      out.errors.push('not ready within ' + job.timeout_ms + ' ms: ' + job.until + ' (' + (e && e.message ? e.message : String(e)) + ')');
    }
    out.result = await page.evaluate(job.collect);
    for (const [path, width, height] of job.screenshots) {
      await page.setViewportSize({ width, height });
      await page.waitForTimeout(100);
      await page.screenshot({ path, fullPage: true });
      out.scrolling.push([width, await page.evaluate(() => [...document.querySelectorAll('.scroll')]
        .filter(e => e.scrollWidth > e.clientWidth + 1)
        .map(e => { const c = e.closest('section'); return c ? (c.dataset.rule || c.id) : 'page'; }))]);
    }
  } finally {
    await context.close();
  }
  process.stdout.write(JSON.stringify(out) + '\n');
})().catch(e => { process.stderr.write(String(e && e.stack ? e.stack : e) + '\n'); process.exit(1); });
"#;

/// Opens a page in headless Chromium and reports what it saw.
pub fn visit(v: &Visit<'_>) -> Result<Seen, String> {
    let profile = std::env::temp_dir().join(format!(
        "ratewall-chromium-{}-{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir_all(&profile).map_err(|e| e.to_string())?;
    let shots: Vec<serde_json::Value> =
        v.screenshots.iter().map(|(p, w, h)| serde_json::json!([p.to_string_lossy(), w, h])).collect();
    let job = serde_json::json!({
        "url": v.url, "until": v.until, "timeout_ms": v.timeout_ms, "collect": v.collect, "screenshots": shots,
        "chromium": chromium_path().to_string_lossy(), "profile": profile.to_string_lossy(),
    });
    let out = Command::new("node")
        .current_dir(root())
        .env("RATEWALL_BROWSER_JOB", job.to_string())
        .env("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
        .args(["-e", DRIVER])
        .output()
        .map_err(|e| format!("node: {e}"))?;
    let _ = std::fs::remove_dir_all(&profile);
    if !out.status.success() {
        return Err(format!("the browser driver failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("the browser driver's answer: {e}: {}", String::from_utf8_lossy(&out.stdout)))?;
    let strings = |k: &str| -> Vec<String> {
        v[k].as_array().map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect()).unwrap_or_default()
    };
    Ok(Seen {
        errors: strings("errors"),
        requests: strings("requests"),
        failed: strings("failed"),
        result: v["result"].clone(),
        scrolling: v["scrolling"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|s| {
                        let names = s[1].as_array().map(|n| n.iter().filter_map(|x| x.as_str().map(str::to_owned)));
                        (s[0].as_u64().unwrap_or(0), names.map(Iterator::collect).unwrap_or_default())
                    })
                    .collect()
            })
            .unwrap_or_default(),
    })
}
