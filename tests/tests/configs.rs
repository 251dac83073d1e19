//! The shipped configurations (Envoy, NGINX, wrangler.toml) carry the example rules, and the
//! built filter accepts them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use ratewall_tests::host::{Node, Plugin, Vm};

fn read(rel: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)).unwrap()
}

/// The block scalar under `value: |` in an Envoy config.
fn envoy_rules_in(file: &str) -> String {
    let yaml = read(file);
    let mut lines = yaml.lines().skip_while(|l| !l.trim_end().ends_with("value: |")).skip(1);
    let first = lines.next().unwrap();
    let indent = first.len() - first.trim_start().len();
    std::iter::once(first)
        .chain(lines.take_while(|l| l.len() - l.trim_start().len() >= indent && !l.trim().is_empty()))
        .map(|l| &l[indent..])
        .collect::<Vec<_>>()
        .join("\n")
}

fn envoy_rules() -> String {
    envoy_rules_in("envoy-config/envoy.yaml")
}

fn nginx_rules() -> String {
    let conf = read("envoy-config/nginx.conf");
    let start = conf.find("proxy_wasm ratewall '").unwrap() + "proxy_wasm ratewall '".len();
    conf[start..].split("';").next().unwrap().to_owned()
}

/// The `RATEWALL_RULES = '''...'''` var of wrangler.toml.
fn wrangler_rules() -> String {
    let toml = read("wrangler.toml");
    let start = toml.find("RATEWALL_RULES = '''").unwrap() + "RATEWALL_RULES = '''".len();
    toml[start..].split("'''").next().unwrap().to_owned()
}

/// examples/rules.json as a host's configuration carries it: without the editor's `$schema`,
/// and under Envoy (`use_remote_address: true`, which appends the peer to X-Forwarded-For)
/// with one more trusted hop.
fn example_for(host: &str) -> serde_json::Value {
    let mut example: serde_json::Value = serde_json::from_str(&read("examples/rules.json")).unwrap();
    example.as_object_mut().unwrap().remove("$schema");
    if host.starts_with("envoy") {
        // The extra hop is Envoy's own append, made under use_remote_address.
        assert!(read(&format!("envoy-config/{host}")).contains("use_remote_address: true"), "{host}");
        let hops = example["identity"]["ip"]["trusted_hops"].as_u64().unwrap();
        example["identity"]["ip"]["trusted_hops"] = (hops + 1).into();
    }
    example
}

/// Every `proxy_wasm ratewall` of the shipped nginx.conf runs in the access phase: in the
/// rewrite phase ngx_wasm_module does not hold a request on a kept-alive connection while it
/// waits for the store (docs/nginx.md).
#[test]
fn the_shipped_nginx_conf_runs_the_filter_in_the_access_phase() {
    let conf = read("envoy-config/nginx.conf");
    let uses: Vec<&str> = conf.split("proxy_wasm ratewall '").collect();
    assert!(uses.len() > 1);
    for before in &uses[..uses.len() - 1] {
        let location = before.rsplit("location").next().unwrap();
        assert!(location.contains("proxy_wasm_request_headers_in_access on;"), "{location}");
    }
}

#[test]
fn shipped_configs_carry_the_example_rules_and_the_filter_accepts_them() {
    for (name, doc) in
        [("envoy.yaml", envoy_rules()), ("nginx.conf", nginx_rules()), ("wrangler.toml", wrangler_rules())]
    {
        let parsed: serde_json::Value = serde_json::from_str(&doc).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(parsed, example_for(name), "{name} drifted from examples/rules.json");
        let node = Node::new(1_700_000_000_000_000_000);
        let mut vm = Vm::start(&Plugin::filter().unwrap(), &node, doc.as_bytes()).unwrap();
        assert!(vm.configure(doc.as_bytes()).unwrap(), "{name}: the host refused the filter: {:?}", node.logs());
        assert_loaded(name, &node, &parsed);
    }
}

/// The filter answers a configure with true whatever the document (a refused one serves the
/// fallback), so what says the rules are in force is its log: the line a user reads.
fn assert_loaded(name: &str, node: &Node, doc: &serde_json::Value) {
    let rules = doc["rules"].as_array().map_or(0, Vec::len);
    assert!(rules > 0, "{name}: no rules");
    let logs = node.logs();
    let loaded = format!("ratewall: loaded {rules} rules");
    assert!(logs.iter().any(|(_, l)| *l == loaded), "{name}: no `{loaded}` in {logs:?}");
    assert!(!logs.iter().any(|(_, l)| l.contains("refused") || l.contains("rejected")), "{name}: {logs:?}");
}

#[test]
fn the_self_hosted_store_config_adds_only_a_sync_section_and_its_cluster() {
    let doc = envoy_rules_in("envoy-config/envoy-store.yaml");
    let mut parsed: serde_json::Value = serde_json::from_str(&doc).unwrap();
    let sync = parsed.as_object_mut().unwrap().remove("sync").expect("a sync section");
    assert_eq!(sync["cluster"], "ratewall_store");
    assert_eq!(parsed, example_for("envoy-store.yaml"), "envoy-store.yaml drifted from examples/rules.json");
    let yaml = read("envoy-config/envoy-store.yaml");
    assert!(yaml.contains("- name: ratewall_store"), "the sync cluster is defined");
    let cfg = ratewall_core::Config::parse(doc.as_bytes()).unwrap();
    assert!(cfg.sync.is_some());
    let node = Node::new(1_700_000_000_000_000_000);
    let mut vm = Vm::start(&Plugin::filter().unwrap(), &node, doc.as_bytes()).unwrap();
    assert!(vm.configure(doc.as_bytes()).unwrap(), "the host refused the filter: {:?}", node.logs());
    assert_loaded("envoy-store.yaml", &node, &parsed);
}
