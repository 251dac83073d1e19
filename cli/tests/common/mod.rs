//! What the CLI's integration tests share: the built binary, paths in the repository, and
//! files written for one test run.

use std::process::{Command, Output};

/// Runs the built `ratewall` with `args`, without a deployment secret in its environment.
pub fn ratewall(args: &[&str]) -> Output {
    ratewall_with(&[], args)
}

/// Runs the built `ratewall` with `args` and the environment variables `env` (none other of
/// those that name a deployment secret).
#[allow(dead_code)]
pub fn ratewall_with(env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ratewall"));
    cmd.env_remove("RATEWALL_SYNC_SECRET").env_remove("RATEWALL_ADMIN_TOKEN").envs(env.iter().copied());
    cmd.args(args).output().unwrap()
}

/// A path in the repository.
pub fn root(path: &str) -> String {
    format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"))
}

/// Writes `text` to `name` (`sub/name` in a directory of its own) in this test binary's
/// scratch directory under `target/` (written over by the next run); its path.
pub fn temp(name: &str, text: &str) -> String {
    let dir =
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(concat!("ratewall-cli-", env!("CARGO_CRATE_NAME")));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    // `name` may be in a directory of its own (`sub/rules.json`).
    std::fs::create_dir_all(p.parent().unwrap_or(&dir)).unwrap();
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().into_owned()
}
