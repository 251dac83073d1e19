//! The core's modules form no circle: `lib.rs` declares them in the order of the data path,
//! and each imports (`crate::…`, outside its tests and comments) only modules declared
//! above it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The modules `lib.rs` declares, in order.
fn modules() -> Vec<String> {
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    lib.lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            l.strip_prefix("mod ")?.strip_suffix(';').map(str::to_owned)
        })
        .collect()
}

/// The non-test, non-comment source of a module (a file or a folder of files).
fn code_of(module: &str) -> String {
    let file = src().join(format!("{module}.rs"));
    let files: Vec<PathBuf> = if file.exists() {
        vec![file]
    } else {
        let mut v: Vec<PathBuf> = std::fs::read_dir(src().join(module))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.file_name().is_some_and(|n| n != "tests.rs"))
            .collect();
        v.sort();
        v
    };
    let mut code = String::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let text = text.split("#[cfg(test)]\nmod tests {").next().unwrap_or("");
        for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
            code.push_str(line);
            code.push('\n');
        }
    }
    code
}

/// The crate modules `code` names as `crate::<module>`.
fn imports(code: &str, modules: &[String]) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if modules.contains(&name) && !found.contains(&name) {
            found.push(name);
        }
    }
    // `use crate::{a, b::c}` groups name several.
    for (at, _) in code.match_indices("crate::{") {
        let group = &code[at + "crate::{".len()..];
        let group = &group[..group.find('}').unwrap_or(group.len())];
        for part in group.split(',') {
            let name = part.trim().split("::").next().unwrap_or("").to_owned();
            if modules.contains(&name) && !found.contains(&name) {
                found.push(name);
            }
        }
    }
    found
}

#[test]
fn every_module_imports_only_modules_declared_above_it() {
    let modules = modules();
    assert!(modules.len() >= 10, "lib.rs declares {modules:?}");
    let mut upward = Vec::new();
    for (i, m) in modules.iter().enumerate() {
        for dep in imports(&code_of(m), &modules) {
            let j = modules.iter().position(|x| *x == dep).unwrap();
            if j >= i && dep != *m {
                upward.push(format!("{m} imports {dep}"));
            }
        }
    }
    assert!(upward.is_empty(), "imports against the order of lib.rs: {upward:?}");
}

#[test]
fn the_scanner_sees_imports() {
    let modules: Vec<String> = ["algo", "rules", "eval"].map(String::from).to_vec();
    let code = "use crate::algo::Limit;\nuse crate::{rules::Config, eval};\nlet x = crate::text(b);\n";
    assert_eq!(imports(code, &modules), ["algo", "rules", "eval"]);
    assert!(code_of("response").contains("crate::eval"), "response builds on eval");
}

#[test]
fn lib_rs_is_a_facade() {
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    let code: Vec<&str> = lib.lines().filter(|l| !l.trim_start().starts_with("//")).collect();
    assert!(!code.iter().any(|l| l.contains("fn ")), "lib.rs defines no functions: it declares and re-exports");
}
