//! `envoy-config/*.yaml` decoded as Envoy's v3 `Bootstrap`, with every typed extension config
//! (`typed_config`'s `@type`) resolved and unknown fields rejected: what `envoy --mode
//! validate` checks of their structure, without an Envoy binary.
//!
//! Envoy's `.proto` files come from the `envoy-types` crate on crates.io (pinned), fetched
//! by `cargo metadata` into cargo's registry without being compiled, and compiled here by
//! protox.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use prost_reflect::{DescriptorPool, DeserializeOptions, DynamicMessage, MessageDescriptor};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The `envoy-types` release whose protos are Envoy's API here.
const ENVOY_TYPES: &str = "0.7.7";

/// The root of `envoy-types`' `proto/` directory in cargo's registry.
fn protos() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = root.join("target/envoy-protos");
    std::fs::create_dir_all(dir.join("src")).unwrap();
    std::fs::write(
        dir.join("Cargo.toml"),
        format!(
            "[package]\nname = \"envoy-protos\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n[workspace]\n\n[dependencies]\nenvoy-types = \"={ENVOY_TYPES}\"\n"
        ),
    )
    .unwrap();
    std::fs::write(dir.join("src/lib.rs"), "").unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(dir.join("Cargo.toml"))
        .output()
        .unwrap();
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let manifest = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "envoy-types")
        .and_then(|p| p["manifest_path"].as_str())
        .expect("envoy-types in the metadata");
    Path::new(manifest).parent().unwrap().join("proto")
}

/// Envoy's `Bootstrap`, with the extensions the configs name.
fn bootstrap() -> MessageDescriptor {
    let root = protos();
    let includes: Vec<PathBuf> = [
        "data-plane-api",
        "xds",
        "googleapis",
        "protoc-gen-validate",
        "cel-spec",
        "opentelemetry-proto",
        "client_model",
    ]
    .iter()
    .map(|d| root.join(d))
    .collect();
    let files = [
        "envoy/config/bootstrap/v3/bootstrap.proto",
        "envoy/extensions/filters/network/http_connection_manager/v3/http_connection_manager.proto",
        "envoy/extensions/filters/http/wasm/v3/wasm.proto",
        "envoy/extensions/filters/http/router/v3/router.proto",
        "envoy/extensions/filters/http/ratelimit/v3/rate_limit.proto",
        "envoy/extensions/upstreams/http/v3/http_protocol_options.proto",
    ];
    let pool = DescriptorPool::from_file_descriptor_set(protox::compile(files, &includes).unwrap()).unwrap();
    pool.get_message_by_name("envoy.config.bootstrap.v3.Bootstrap").unwrap()
}

fn decode(desc: &MessageDescriptor, yaml: &str) -> Result<DynamicMessage, String> {
    let value: serde_json::Value = serde_yaml::from_str(yaml).map_err(|e| e.to_string())?;
    let opts = DeserializeOptions::new().deny_unknown_fields(true);
    DynamicMessage::deserialize_with_options(desc.clone(), &value, &opts).map_err(|e| e.to_string())
}

#[test]
fn the_envoy_configs_are_valid_v3_bootstraps_and_a_typo_anywhere_is_caught() {
    let desc = bootstrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../envoy-config");
    for name in ["envoy.yaml", "envoy-store.yaml", "envoy-rls.yaml"] {
        let yaml = std::fs::read_to_string(root.join(name)).unwrap();
        if let Err(e) = decode(&desc, &yaml) {
            panic!("envoy-config/{name} is not a valid v3 Bootstrap: {e}");
        }
        if name == "envoy-rls.yaml" {
            // The rate limit filter's config, its route actions and the h2c cluster's
            // protocol options are typed too.
            for (from, to) in [
                ("failure_mode_deny:", "failure_mode_deni:"),
                ("descriptor_key:", "descriptor_kee:"),
                ("http2_protocol_options:", "http2_protocol_option:"),
                ("ratelimit.v3.RateLimit\n", "ratelimit.v3.RateLimits\n"),
            ] {
                assert!(yaml.contains(from), "{name} has {from}");
                assert!(decode(&desc, &yaml.replacen(from, to, 1)).is_err(), "{name} with {to} was accepted");
            }
            continue;
        }
        // The check can fail: a typo in the Wasm filter's config (inside two typed configs),
        // in the connection manager's, and an unknown extension type are each refused.
        for (from, to) in
            [("vm_config:", "vm_confg:"), ("stat_prefix:", "stat_prefx:"), ("router.v3.Router", "router.v3.Ruter")]
        {
            assert!(yaml.contains(from), "{name} has {from}");
            let broken = yaml.replacen(from, to, 1);
            assert!(decode(&desc, &broken).is_err(), "{name} with {to} was accepted");
        }
    }
}
