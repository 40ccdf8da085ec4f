//! The e2e scripts build what they start and never wait without a deadline
//! (issue 15): read from the scripts themselves, so a new script or binary
//! that breaks either rule fails here, not on a fresh machine.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every shell script the README, CI and the other scripts run.
fn scripts() -> Vec<PathBuf> {
    let mut out = vec![root().join(".ci/run"), root().join("config/generate")];
    for entry in std::fs::read_dir(root().join("e2e")).expect("e2e/") {
        let path = entry.expect("entry").path();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if path.is_file() && text.starts_with("#!") || path.extension().is_some_and(|e| e == "sh") {
            out.push(path);
        }
    }
    out
}

/// The binaries `e2e/build-binaries` builds (its BINS list).
fn built() -> BTreeSet<String> {
    let text = std::fs::read_to_string(root().join("e2e/build-binaries")).expect("build step");
    let line = text
        .lines()
        .find(|l| l.starts_with("BINS=("))
        .expect("e2e/build-binaries has a BINS=(...) line");
    line.trim_start_matches("BINS=(")
        .trim_end_matches(')')
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Cargo binary names a script starts: `.../debug/x`, or `$BIN/x` where
/// `BIN` is the cargo target's debug directory.
fn started_by(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut markers = vec!["/debug/"];
    if text.contains("BIN=$CARGO_TARGET_DIR/debug") {
        markers.push("$BIN/");
    }
    for marker in markers {
        for (i, _) in text.match_indices(marker) {
            let rest = &text[i + marker.len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect();
            if !name.is_empty() {
                names.insert(name);
            }
        }
    }
    names
}

/// The bin targets of the workspace's members (`cargo metadata`).
fn workspace_bins() -> BTreeSet<String> {
    let out = std::process::Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--locked",
            "--offline",
            "--no-deps",
            "--format-version",
            "1",
        ])
        .current_dir(root())
        .output()
        .expect("running cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .flat_map(|p| p["targets"].as_array().expect("targets"))
        .filter(|t| t["kind"][0] == "bin")
        .map(|t| t["name"].as_str().expect("a name").to_string())
        .collect()
}

#[test]
fn the_build_step_builds_every_binary_of_the_workspace() {
    assert_eq!(
        built(),
        workspace_bins(),
        "e2e/build-binaries must build every [[bin]] of the workspace's members"
    );
}

#[test]
fn every_script_builds_the_binaries_it_starts() {
    let built = built();
    let mut checked = 0;
    for script in scripts() {
        let text = std::fs::read_to_string(&script).expect("script");
        let started = started_by(&text);
        if started.is_empty() {
            continue;
        }
        checked += 1;
        let name = script.strip_prefix(root()).unwrap().display().to_string();
        for bin in &started {
            assert!(
                built.contains(bin),
                "{name} starts {bin}, which e2e/build-binaries does not build"
            );
        }
        assert!(
            text.contains("build-binaries"),
            "{name} starts {started:?} but never runs e2e/build-binaries: on a fresh machine they do not exist"
        );
    }
    assert!(
        checked >= 2,
        "expected e2e/demo and e2e/cluster to start binaries"
    );
}

#[test]
fn every_wait_in_the_scripts_has_a_deadline() {
    // The one polling loop lives in e2e/lib.sh (`wait_up`, with a deadline
    // and a check that the awaited process still runs); scripts call it.
    for script in scripts() {
        let name = script.strip_prefix(root()).unwrap().display().to_string();
        if name == "e2e/lib.sh" {
            continue;
        }
        let text = std::fs::read_to_string(&script).expect("script");
        for (n, line) in text.lines().enumerate() {
            let code = line.split('#').next().unwrap_or("");
            assert!(
                !code.contains("until ")
                    && !code.contains("while true")
                    && !code.contains("while :"),
                "{name}:{}: an open-ended wait; use wait_up from e2e/lib.sh (deadline, dead-process check)",
                n + 1
            );
            assert!(
                !code.contains("setsid") || code.contains("spawn"),
                "{name}:{}: start background processes with spawn from e2e/lib.sh (it checks the executable exists)",
                n + 1
            );
        }
    }
}

/// Runs `script` in bash with e2e/cluster sourced (its functions, no
/// command), its state in a fresh temporary directory; returns stdout.
fn with_cluster_functions(script: &str, env: &[(&str, &str)]) -> String {
    let state = tempfile::tempdir().expect("temp dir");
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!(". e2e/cluster\n{script}"))
        .current_dir(root())
        .env("AGENTRUN_CLUSTER_DIR", state.path())
        .env_remove("AGENTRUN_NODE")
        .env_remove("AGENTRUN_MUTATING_ADMISSION_POLICY")
        .envs(env.iter().copied())
        .output()
        .expect("running bash");
    assert!(
        out.status.success(),
        "{script}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

#[test]
fn the_cluster_has_a_front_proxy_ca_of_its_own_whose_client_the_api_server_presents() {
    let out = with_cluster_functions(
        "mkdir -p \"$STATE\" && make_pki >/dev/null\n\
         openssl verify -CAfile \"$PKI/front-proxy-ca.crt\" \"$PKI/front-proxy-client.crt\"\n\
         openssl verify -CAfile \"$PKI/ca.crt\" \"$PKI/front-proxy-client.crt\" 2>&1 || echo not-by-the-cluster-ca\n\
         openssl x509 -in \"$PKI/front-proxy-client.crt\" -noout -subject -ext extendedKeyUsage\n\
         echo \"flags: ${AGGREGATION_FLAGS[*]}\"",
        &[],
    );
    assert!(
        out.contains("front-proxy-client.crt: OK"),
        "signed by the front-proxy CA:\n{out}"
    );
    assert!(
        out.contains("not-by-the-cluster-ca"),
        "a person's CA must not sign it:\n{out}"
    );
    assert!(
        out.contains("CN = front-proxy-client") && out.contains("TLS Web Client Authentication"),
        "{out}"
    );
    let flags = out.lines().find_map(|l| l.strip_prefix("flags: ")).unwrap();
    for flag in [
        "--requestheader-client-ca-file",
        "--requestheader-allowed-names front-proxy-client",
        "--requestheader-username-headers X-Remote-User",
        "--requestheader-group-headers X-Remote-Group",
        "--requestheader-extra-headers-prefix X-Remote-Extra-",
        "--proxy-client-cert-file",
        "--proxy-client-key-file",
        "--enable-aggregator-routing=true",
    ] {
        assert!(flags.contains(flag), "the API server gets {flag}: {flags}");
    }
}

#[test]
fn mutating_admission_policy_is_on_for_the_process_node_and_off_for_the_real_node_unless_told() {
    let flags = |kind: &str, knob: Option<&str>| {
        let mut env = vec![("AGENTRUN_NODE", kind)];
        if let Some(knob) = knob {
            env.push(("AGENTRUN_MUTATING_ADMISSION_POLICY", knob));
        }
        with_cluster_functions("admission_flags; echo \"${ADMISSION_FLAGS[*]}\"", &env)
    };
    let served = |f: &str| {
        f.contains(",MutatingAdmissionPolicy,")
            && f.contains("--feature-gates MutatingAdmissionPolicy=true")
            && f.contains("admissionregistration.k8s.io/v1beta1=true")
    };
    assert!(served(&flags("process", None)), "process node: on");
    assert!(!served(&flags("real", None)), "real node: off");
    assert!(!flags("real", None).contains("MutatingAdmissionPolicy"));
    assert!(!served(&flags("process", Some("off"))), "told off");
    assert!(served(&flags("real", Some("on"))), "told on");
    for f in [flags("process", None), flags("real", None)] {
        assert!(
            f.contains("MutatingAdmissionWebhook") && f.contains("ValidatingAdmissionPolicy"),
            "webhooks and validating policies either way: {f}"
        );
    }
}

/// `e2e/install-host ARGS...`: the demo's install (stdout lines).
fn install_host(args: &[&str]) -> Vec<String> {
    let out = std::process::Command::new(root().join("e2e/install-host"))
        .args(args)
        .output()
        .expect("running e2e/install-host");
    assert!(
        out.status.success(),
        "e2e/install-host {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .map(str::to_string)
        .collect()
}

/// The `  - NAME` resources of a kustomization.yaml.
fn kustomize_resources(dir: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join(dir).join("kustomization.yaml")).expect(dir);
    text.lines()
        .filter_map(|l| l.strip_prefix("  - "))
        .map(str::to_string)
        .collect()
}

/// The kinds of the objects in a YAML file.
fn kinds(path: &str) -> BTreeSet<String> {
    std::fs::read_to_string(root().join(path))
        .expect(path)
        .lines()
        .filter_map(|l| l.strip_prefix("kind: "))
        .map(str::to_string)
        .collect()
}

// The demo world is an installation (issue 40): e2e/demo applies every object
// of config/ (which e2e/suites/tests/packaging.rs keeps equal to the chart's
// render), so its rights are the chart's; only the Deployment and the
// Services selecting its pods are replaced by the controller on the host.
#[test]
fn the_demo_installs_every_object_of_config_but_the_controllers_pods() {
    let config = root().join("config");
    let rel = |p: &str| {
        Path::new(p)
            .strip_prefix(&config)
            .unwrap_or_else(|_| panic!("{p} is not under config/"))
            .display()
            .to_string()
    };
    let replaced = ["manager.yaml", "service.yaml"];
    for stamp in ["webhook", "policy"] {
        let applied: BTreeSet<String> = install_host(&["files", stamp])
            .iter()
            .map(|p| rel(p))
            .collect();
        for dir in kustomize_resources("config/default") {
            let dir = dir.trim_start_matches("../").to_string();
            if dir == "manager" {
                continue;
            }
            assert!(
                applied.contains(&dir),
                "with the {stamp}, the demo does not apply config/{dir}: {applied:?}"
            );
        }
        for file in kustomize_resources("config/manager") {
            let want = match (stamp, file.as_str()) {
                (_, f) if replaced.contains(&f) => continue,
                ("policy", "requester_stamp.yaml") => {
                    "requester-stamp/mutating-policy.yaml".to_string()
                }
                _ => format!("manager/{file}"),
            };
            assert!(
                applied.contains(&want),
                "with the {stamp}, the demo does not apply config/{want}: {applied:?}"
            );
        }
        let stamps = applied.iter().filter(|f| f.contains("requester")).count();
        assert_eq!(
            stamps, 1,
            "one requester stamp with the {stamp}: {applied:?}"
        );
    }
    // What the host process replaces grants no rights and configures nothing
    // the demo would miss.
    for file in replaced {
        let found = kinds(&format!("config/manager/{file}"));
        let allowed: BTreeSet<String> = ["Deployment", "PodDisruptionBudget", "Service"]
            .map(String::from)
            .into();
        assert!(
            found.is_subset(&allowed),
            "config/manager/{file} holds {found:?}: the demo must apply those"
        );
    }
}

#[test]
fn the_demos_controller_gets_the_flags_of_the_charts_deployment() {
    let manifest =
        std::fs::read_to_string(root().join("config/manager/manager.yaml")).expect("manager.yaml");
    let flags: Vec<&str> = manifest
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- --"))
        .collect();
    assert!(
        flags.len() > 5,
        "config/manager/manager.yaml: no controller flags found"
    );
    for stamp in ["webhook", "policy"] {
        let got = install_host(&["controller", stamp]);
        for flag in &flags {
            let line = format!("arg --{flag}");
            // Where the API server serves the policy, the chart (auto) has no webhook to inject.
            let expected = !(stamp == "policy" && flag.starts_with("inject-ca-webhook="));
            assert_eq!(got.contains(&line), expected, "{stamp}: {line} in {got:?}");
        }
        // Its environment: every variable the Deployment sets.
        for name in manifest
            .lines()
            .filter_map(|l| l.trim().strip_prefix("- name: "))
        {
            if name.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
                assert!(
                    got.iter()
                        .any(|l| l == &format!("env {name}")
                            || l.starts_with(&format!("env {name}="))),
                    "{stamp}: the controller's env {name} is missing: {got:?}"
                );
            }
        }
    }
}

// The plugin looks for the controller's keys where the chart (and config/,
// and so the demo) publishes them and lets every authenticated user read them.
#[test]
fn the_plugin_looks_for_the_keys_where_the_chart_lets_everyone_read_them() {
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_kubectl-agentrun"))
        .args(["log", "--help"])
        .env_remove("AGENTRUN_CONTROLLER_NAMESPACE")
        .output()
        .expect("kubectl-agentrun log --help");
    let help = String::from_utf8_lossy(&help.stdout).to_string();
    assert!(help.contains("[default: agentrun-system]"), "{help}");
    let roles = std::fs::read_to_string(root().join("config/rbac/role.yaml")).expect("role.yaml");
    let reader = roles
        .split("\n---\n")
        .find(|d| d.contains("kind: Role\n") && d.contains("name: agentrun-controller-keys-reader"))
        .expect("the keys reader Role in config/rbac/role.yaml");
    assert!(reader.contains("namespace: agentrun-system"), "{reader}");
    let binding = roles
        .split("\n---\n")
        .find(|d| {
            d.contains("kind: RoleBinding")
                && d.contains("name: agentrun-controller-keys-reader\n  namespace")
        })
        .expect("its RoleBinding");
    assert!(
        binding.contains("namespace: agentrun-system")
            && binding.contains("name: system:authenticated"),
        "{binding}"
    );
}

#[test]
fn the_cluster_env_puts_the_plugin_where_a_second_shells_kubectl_finds_it() {
    let target = tempfile::tempdir().expect("temp dir");
    let plugin = target.path().join("debug/kubectl-agentrun");
    std::fs::create_dir_all(plugin.parent().unwrap()).expect("debug/");
    std::fs::write(&plugin, "#!/bin/sh\n").expect("a plugin");
    std::fs::set_permissions(&plugin, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("executable");
    // A shell with only the system's PATH, as a person's second terminal.
    let out = with_cluster_functions(
        "link_plugin\n\
         PATH=/usr/bin:/bin\n\
         eval \"$(cmd_env)\"\n\
         readlink -f \"$(command -v kubectl-agentrun)\"",
        &[("CARGO_TARGET_DIR", target.path().to_str().expect("utf-8"))],
    );
    assert_eq!(
        out.trim(),
        plugin
            .canonicalize()
            .expect("plugin path")
            .to_str()
            .unwrap(),
        "after eval \"$(e2e/cluster env)\", kubectl-agentrun is the one e2e/build-binaries built"
    );
}

#[test]
fn the_tour_ci_runs_is_the_readmes_tour_section() {
    let out = std::process::Command::new("bash")
        .args(["e2e/tour", "--print"])
        .current_dir(root())
        .output()
        .expect("running e2e/tour --print");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tour = String::from_utf8(out.stdout).expect("utf-8");
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let section = readme
        .split("## A five-minute tour")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("README.md has a section '## A five-minute tour'");
    let commands: Vec<&str> = tour.lines().filter(|l| !l.is_empty()).collect();
    assert!(
        commands.len() >= 5 && commands[0].starts_with("eval \"$(e2e/cluster env)\""),
        "the tour starts with the cluster's env and has its commands: {commands:?}"
    );
    for command in &commands {
        assert!(section.contains(command), "{command:?} is not the README's");
    }
    assert!(
        commands.iter().any(|c| c.contains("approve"))
            && commands.iter().any(|c| c.contains("verify")),
        "the tour approves and verifies: {commands:?}"
    );
    let ci = std::fs::read_to_string(root().join(".ci/run")).expect(".ci/run");
    assert!(ci.contains("e2e/tour"), "CI runs the tour");
}
