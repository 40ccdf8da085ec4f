//! The Grafana dashboard the chart ships (charts/agentrun/dashboards/agentrun.json):
//! it is a dashboard with queries on every panel, every metric and label its
//! queries name is one the controller exports (taken from the controller's own
//! registry, encoded as /metrics encodes it, not from a list kept here), and
//! the chart renders its ConfigMap only when `grafana.dashboard.enabled`.
//!
//! helm is built from its Go module by `e2e/build-helm.sh` (cached in
//! ~/.cache/agentrun), as for tests/packaging.rs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

use prometheus_client::registry::Registry;
use serde::Deserialize as _;
use serde_json::{Value, json};

use agentrun::controller::metrics;

mod common;
use common::root;
use common::scripts::{helm_lint, helm_run};

const DASHBOARD: &str = "charts/agentrun/dashboards/agentrun.json";

fn dashboard() -> Value {
    let text = std::fs::read_to_string(root().join(DASHBOARD)).expect("reading the dashboard");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{DASHBOARD} is not JSON: {e}"))
}

/// Every panel, rows' nested panels included.
fn panels(dash: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for p in list.as_array().into_iter().flatten() {
            out.push(p);
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dash["panels"], &mut out);
    out
}

/// (panel title, expression) of every query of every panel.
fn exprs(dash: &Value) -> Vec<(String, String)> {
    panels(dash)
        .into_iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or("?").to_string();
            p["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(move |t| Some((title.clone(), t["expr"].as_str()?.to_string())))
        })
        .collect()
}

/// What the controller's /metrics exposes: sample names (with the suffixes
/// their type adds) and label names.
struct Exported {
    /// sample name → its family's name
    samples: BTreeMap<String, String>,
    families: BTreeSet<String>,
    labels: BTreeSet<String>,
}

fn exported() -> &'static Exported {
    static EXPORTED: OnceLock<Exported> = OnceLock::new();
    EXPORTED.get_or_init(|| {
        let mut registry = Registry::default();
        let m = metrics::Metrics::new(&mut registry);
        // The runs gauge is computed from the leader's cache: give it one (empty).
        let (runs, _writer) = kube::runtime::reflector::store::<agentrun::api::AgentRun>();
        m.watch_runs(runs);
        // One sample in each labelled family, so that its label names show.
        let outcome = || metrics::OutcomeLabel {
            outcome: "x".into(),
        };
        m.reconcile_errors
            .get_or_create(&metrics::ReasonLabel { reason: "x".into() })
            .inc();
        m.steps
            .get_or_create(&metrics::KindLabel { kind: "x".into() })
            .inc();
        m.step_duration.get_or_create(&outcome()).observe(1.0);
        m.approval_wait
            .get_or_create(&metrics::VerdictLabel {
                verdict: "x".into(),
            })
            .observe(1.0);
        m.model_tokens
            .get_or_create(&metrics::TokenLabel {
                direction: "x".into(),
                model: "x".into(),
            })
            .inc();
        m.model_cost
            .get_or_create(&metrics::ModelLabel { model: "x".into() })
            .inc();
        m.store_append.get_or_create(&outcome()).observe(1.0);
        m.dispatch
            .get_or_create(&metrics::StageLabel { stage: "x" })
            .observe(1.0);

        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let mut samples = BTreeMap::new();
        let mut families = BTreeSet::new();
        let mut labels = BTreeSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("# TYPE name type");
                families.insert(name.to_string());
                let suffixes: &[&str] = match kind {
                    "counter" if name.ends_with("_total") => &[""],
                    "counter" => &["_total"],
                    "histogram" => &["_bucket", "_sum", "_count"],
                    "gauge" | "unknown" => &[""],
                    "info" => &["_info"],
                    other => panic!("metric type {other} of {name}: teach this test its suffixes"),
                };
                samples.extend(
                    suffixes
                        .iter()
                        .map(|s| (format!("{name}{s}"), name.to_string())),
                );
            } else if !line.starts_with('#')
                && let Some((_, rest)) = line.split_once('{')
            {
                // name{a="..",b=".."} value (the values set above need no escaping)
                let set = rest.split_once('}').expect("closed label set").0;
                for pair in set.split(',') {
                    labels.insert(pair.split_once('=').expect("label=value").0.to_string());
                }
            }
        }
        // Every family the module registers and every sample line it exposes
        // must have been understood above.
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let name = line.split(['{', ' ']).next().unwrap();
            assert!(
                samples.contains_key(name),
                "sample {name} not expected:\n{text}"
            );
        }
        assert!(
            [
                "agentrun_reconciliations_total",
                "agentrun_runs",
                "agentrun_reconcile_duration_seconds_bucket"
            ]
            .iter()
            .all(|s| samples.contains_key(*s)),
            "the encoded registry lacks the controller's metrics:\n{text}"
        );
        Exported {
            samples,
            families,
            labels,
        }
    })
}

/// Labels Prometheus adds to what it scrapes (the namespace variable filters on
/// one), and the histogram bucket bound.
const TARGET_LABELS: [&str; 6] = ["namespace", "pod", "instance", "job", "service", "le"];

/// PromQL functions, aggregation operators and keywords (prometheus.io's
/// querying reference).
const PROMQL_WORDS: &[&str] = &[
    // aggregation operators
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
    // binary operators and modifiers
    "and",
    "or",
    "unless",
    "atan2",
    "bool",
    "offset",
    "start",
    "end",
    // functions
    "abs",
    "absent",
    "absent_over_time",
    "ceil",
    "changes",
    "clamp",
    "clamp_max",
    "clamp_min",
    "day_of_month",
    "day_of_week",
    "day_of_year",
    "days_in_month",
    "delta",
    "deriv",
    "exp",
    "floor",
    "histogram_avg",
    "histogram_count",
    "histogram_fraction",
    "histogram_quantile",
    "histogram_stddev",
    "histogram_stdvar",
    "histogram_sum",
    "holt_winters",
    "hour",
    "idelta",
    "increase",
    "irate",
    "label_join",
    "label_replace",
    "ln",
    "log2",
    "log10",
    "minute",
    "month",
    "predict_linear",
    "rate",
    "resets",
    "round",
    "scalar",
    "sgn",
    "sort",
    "sort_desc",
    "sort_by_label",
    "sort_by_label_desc",
    "sqrt",
    "time",
    "timestamp",
    "vector",
    "year",
    "avg_over_time",
    "min_over_time",
    "max_over_time",
    "sum_over_time",
    "count_over_time",
    "quantile_over_time",
    "stddev_over_time",
    "stdvar_over_time",
    "last_over_time",
    "present_over_time",
    "acos",
    "acosh",
    "asin",
    "asinh",
    "atan",
    "atanh",
    "cos",
    "cosh",
    "sin",
    "sinh",
    "tan",
    "tanh",
    "deg",
    "pi",
    "rad",
    "inf",
    "nan",
];

/// Keywords whose parenthesised list holds label names.
const GROUPING: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// What one expression references: metric names, label names, and words
/// that are neither a PromQL word nor a label (so metric names).
#[derive(Default, Debug)]
struct Refs {
    metrics: BTreeSet<String>,
    labels: BTreeSet<String>,
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// Scans a PromQL expression (with Grafana's `$var`/`${var}` in it).
fn scan(expr: &str) -> Refs {
    let chars: Vec<char> = expr.chars().collect();
    let mut refs = Refs::default();
    let mut i = 0;
    let ident = |i: &mut usize| -> String {
        let start = *i;
        while *i < chars.len() && is_ident(chars[*i]) {
            *i += 1;
        }
        chars[start..*i].iter().collect()
    };
    let skip_ws = |i: &mut usize| {
        while *i < chars.len() && chars[*i].is_whitespace() {
            *i += 1;
        }
    };
    // Skips a string literal starting at chars[*i].
    let skip_string = |i: &mut usize| {
        let quote = chars[*i];
        *i += 1;
        while *i < chars.len() && chars[*i] != quote {
            if chars[*i] == '\\' && quote != '`' {
                *i += 1;
            }
            *i += 1;
        }
        assert!(*i < chars.len(), "unterminated string in {expr}");
        *i += 1;
    };
    // Skips $name or ${name}.
    let skip_var = |i: &mut usize| {
        *i += 1;
        if chars.get(*i) == Some(&'{') {
            while *i < chars.len() && chars[*i] != '}' {
                *i += 1;
            }
            *i += 1;
        } else {
            while *i < chars.len() && is_ident(chars[*i]) {
                *i += 1;
            }
        }
    };
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            skip_string(&mut i);
        } else if c == '$' {
            skip_var(&mut i);
        } else if c == '[' {
            // range or subquery: durations and Grafana variables only
            while i < chars.len() && chars[i] != ']' {
                i += 1;
            }
            i += 1;
        } else if c == '{' {
            // label matchers: name op "value", ...
            i += 1;
            loop {
                skip_ws(&mut i);
                match chars.get(i) {
                    None => panic!("unclosed {{ in {expr}"),
                    Some('}') => {
                        i += 1;
                        break;
                    }
                    Some(',') => i += 1,
                    Some('"' | '\'' | '`') => skip_string(&mut i),
                    Some('$') => skip_var(&mut i),
                    Some(&c) if is_ident_start(c) => {
                        let name = ident(&mut i);
                        skip_ws(&mut i);
                        let op: String = chars[i..(i + 2).min(chars.len())].iter().collect();
                        assert!(
                            op.starts_with('=') || op == "!=" || op == "!~",
                            "label {name} without a matcher in {expr}"
                        );
                        refs.labels.insert(name);
                    }
                    Some(_) => i += 1,
                }
            }
        } else if c.is_ascii_digit()
            || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            // numbers and durations (1e-3, 0x1f, 5m)
            while i < chars.len() && (is_ident(chars[i]) || chars[i] == '.') {
                i += 1;
            }
        } else if is_ident_start(c) {
            let word = ident(&mut i);
            let lower = word.to_ascii_lowercase();
            if GROUPING.contains(&lower.as_str()) {
                skip_ws(&mut i);
                if chars.get(i) == Some(&'(') {
                    let close = i + chars[i..]
                        .iter()
                        .position(|&c| c == ')')
                        .unwrap_or_else(|| panic!("unclosed ( after {word} in {expr}"));
                    let list: String = chars[i + 1..close].iter().collect();
                    for label in list.split(',').map(str::trim).filter(|l| !l.is_empty()) {
                        assert!(
                            label.chars().all(is_ident),
                            "{label:?} in {word}(...) of {expr}"
                        );
                        refs.labels.insert(label.to_string());
                    }
                    i = close + 1;
                }
            } else if !PROMQL_WORDS.contains(&lower.as_str()) {
                refs.metrics.insert(word);
            }
        } else {
            i += 1;
        }
    }
    refs
}

/// The queries of the dashboard's template variables, as PromQL scanned like
/// the panels' (`label_values(selector, label)` is Grafana's, not PromQL).
fn variable_refs(dash: &Value) -> Vec<(String, Refs)> {
    let mut out = Vec::new();
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        if v["type"] != "query" {
            continue;
        }
        let q = v["query"]["query"]
            .as_str()
            .or(v["query"].as_str())
            .unwrap_or_else(|| panic!("variable {} has no query", v["name"]))
            .trim()
            .to_string();
        let refs = if let Some(args) = q
            .strip_prefix("label_values(")
            .and_then(|a| a.strip_suffix(')'))
        {
            match args.rsplit_once(',') {
                Some((selector, label)) => {
                    let mut refs = scan(selector);
                    refs.labels.insert(label.trim().to_string());
                    refs
                }
                None => Refs {
                    labels: [args.trim().to_string()].into(),
                    ..Refs::default()
                },
            }
        } else if let Some(expr) = q
            .strip_prefix("query_result(")
            .and_then(|a| a.strip_suffix(')'))
        {
            scan(expr)
        } else {
            panic!(
                "variable {}: query {q:?} is neither label_values nor query_result",
                v["name"]
            )
        };
        out.push((format!("variable {}", v["name"]), refs));
    }
    out
}

#[test]
fn the_scanner_finds_metrics_and_labels() {
    let r = scan(
        r#"histogram_quantile(0.99, sum by (le, stage) (rate(agentrun_dispatch_seconds_bucket{namespace=~"$namespace", stage!="a,b}"}[$__rate_interval]))) / on() group_left sum without (pod) (up offset 5m) > bool 1e-3"#,
    );
    assert_eq!(
        r.metrics,
        BTreeSet::from(["agentrun_dispatch_seconds_bucket".into(), "up".into()])
    );
    assert_eq!(
        r.labels,
        BTreeSet::from([
            "le".into(),
            "stage".into(),
            "namespace".into(),
            "pod".into()
        ])
    );
}

#[test]
fn the_dashboard_is_a_grafana_dashboard_with_a_query_on_every_panel() {
    let dash = dashboard();
    assert!(dash["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(dash["uid"].as_str().is_some_and(|u| !u.is_empty()));
    assert!(
        dash["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
        "schemaVersion {}",
        dash["schemaVersion"]
    );
    // Provisioned dashboards carry no database id.
    assert!(dash["id"].is_null());

    let vars: BTreeMap<&str, &Value> = dash["templating"]["list"]
        .as_array()
        .expect("templating.list")
        .iter()
        .map(|v| (v["name"].as_str().expect("variable name"), v))
        .collect();
    let ds = vars.get("datasource").expect("a datasource variable");
    assert_eq!(ds["type"], "datasource");
    assert_eq!(ds["query"], "prometheus");
    let ns = vars.get("namespace").expect("a namespace variable");
    assert_eq!(ns["type"], "query");
    assert_eq!(ns["datasource"]["uid"], "${datasource}");

    let all = panels(&dash);
    let queried: Vec<&&Value> = all.iter().filter(|p| p["type"] != "row").collect();
    assert!(queried.len() >= 10, "{} panels", queried.len());
    let mut ids = BTreeSet::new();
    for p in &all {
        let id = p["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("panel without id: {p}"));
        assert!(ids.insert(id), "panel id {id} twice");
    }
    for p in &queried {
        let title = p["title"]
            .as_str()
            .unwrap_or_else(|| panic!("untitled panel {p}"));
        assert_eq!(p["datasource"]["uid"], "${datasource}", "panel {title}");
        let targets = p["targets"]
            .as_array()
            .unwrap_or_else(|| panic!("panel {title} has no targets"));
        assert!(!targets.is_empty(), "panel {title} has no targets");
        let mut refids = BTreeSet::new();
        for t in targets {
            let expr = t["expr"].as_str().unwrap_or("");
            assert!(
                !expr.trim().is_empty(),
                "panel {title}: target without expr: {t}"
            );
            assert!(
                refids.insert(t["refId"].to_string()),
                "panel {title}: refId twice"
            );
            assert_eq!(t["datasource"]["uid"], "${datasource}", "panel {title}");
            // Every query is narrowed to the chosen namespaces.
            assert!(
                expr.contains(r#"namespace=~"$namespace""#),
                "panel {title}: {expr} ignores $namespace"
            );
        }
    }

    // Panels do not overlap on the 24-column grid.
    let boxes: Vec<(&str, [u64; 4])> = all
        .iter()
        .map(|p| {
            let g = &p["gridPos"];
            let n = |k: &str| {
                g[k].as_u64()
                    .unwrap_or_else(|| panic!("gridPos.{k} of {p}"))
            };
            (
                p["title"].as_str().unwrap_or("?"),
                [n("x"), n("y"), n("w"), n("h")],
            )
        })
        .collect();
    for (i, (a, [ax, ay, aw, ah])) in boxes.iter().enumerate() {
        assert!(ax + aw <= 24, "panel {a} is wider than the grid");
        for (b, [bx, by, bw, bh]) in &boxes[i + 1..] {
            let apart = ax + aw <= *bx || bx + bw <= *ax || ay + ah <= *by || by + bh <= *ay;
            assert!(apart, "panels {a} and {b} overlap");
        }
    }
}

#[test]
fn every_metric_and_label_the_dashboard_queries_is_exported_by_the_controller() {
    let dash = dashboard();
    let exported = exported();
    let mut refs: Vec<(String, Refs)> = exprs(&dash)
        .into_iter()
        .map(|(title, expr)| {
            let refs = scan(&expr);
            (format!("panel {title}: {expr}"), refs)
        })
        .collect();
    refs.extend(variable_refs(&dash));
    let mut problems = Vec::new();
    for (what, r) in &refs {
        if r.metrics.is_empty() {
            problems.push(format!("{what} names no metric"));
        }
        for m in &r.metrics {
            if !exported.samples.contains_key(m) {
                problems.push(format!(
                    "{what} uses {m}, which the controller does not export"
                ));
            }
        }
        for l in &r.labels {
            if !exported.labels.contains(l) && !TARGET_LABELS.contains(&l.as_str()) {
                problems.push(format!(
                    "{what} uses label {l}, which no exported metric has"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{}\n\nexported: {:?}\nlabels: {:?}",
        problems.join("\n"),
        exported.samples.keys(),
        exported.labels
    );
}

#[test]
fn the_dashboard_shows_every_metric_the_controller_exports() {
    let dash = dashboard();
    let used: BTreeSet<String> = exprs(&dash)
        .into_iter()
        .flat_map(|(_, e)| scan(&e).metrics)
        .collect();
    let exported = exported();
    let shown: BTreeSet<&String> = used
        .iter()
        .filter_map(|u| exported.samples.get(u))
        .collect();
    let missing: Vec<&String> = exported
        .families
        .iter()
        .filter(|f| !shown.contains(f))
        .collect();
    assert!(
        missing.is_empty(),
        "metrics on no panel of {DASHBOARD}: {missing:?}"
    );
}

// --- The chart's ConfigMap -------------------------------------------------

/// `helm template` of the chart with `values`: the objects, or helm's error.
fn render(values: &Value) -> Result<Vec<Value>, String> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.json");
    std::fs::write(&file, values.to_string()).unwrap();
    let (ok, stdout, stderr) = helm_run(&[
        "template",
        "agentrun",
        "charts/agentrun",
        "--namespace",
        "agentrun-system",
        "--values",
        file.to_str().unwrap(),
    ]);
    if !ok {
        return Err(stderr);
    }
    Ok(serde_yaml::Deserializer::from_str(&stdout)
        .map(|d| serde_yaml::Value::deserialize(d).expect("valid YAML"))
        .filter(|v| !v.is_null())
        .map(|v| serde_json::to_value(v).expect("YAML as JSON"))
        .collect())
}

fn with_store(mut values: Value) -> Value {
    values["store"] = json!({"existingSecret": "agentrun-store"});
    values["controller"]["stepTokenKey"] = json!({"existingSecret": "agentrun-step-token-key"});
    // A render without the cluster cannot keep a chart-made certificate.
    values["servingCert"] = json!({"mode": "controller"});
    values
}

fn dashboard_configmaps(objs: &[Value]) -> Vec<&Value> {
    objs.iter()
        .filter(|o| o["kind"] == "ConfigMap" && o["data"].get("agentrun.json").is_some())
        .collect()
}

#[test]
fn the_chart_ships_the_dashboard_only_when_enabled() {
    // Off by default.
    let objs = render(&with_store(json!({}))).expect("renders");
    assert!(
        dashboard_configmaps(&objs).is_empty(),
        "a dashboard ConfigMap without grafana.dashboard.enabled"
    );
    assert!(
        !objs
            .iter()
            .any(|o| o["metadata"]["name"] == "agentrun-dashboard"),
        "agentrun-dashboard rendered while disabled"
    );

    // On: the sidecar's default label, the file as it is in the chart.
    let objs = render(&with_store(
        json!({"grafana": {"dashboard": {"enabled": true}}}),
    ))
    .expect("renders");
    let cms = dashboard_configmaps(&objs);
    assert_eq!(cms.len(), 1, "{cms:?}");
    let cm = cms[0];
    assert_eq!(cm["metadata"]["name"], "agentrun-dashboard");
    assert_eq!(cm["metadata"]["namespace"], "agentrun-system");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(
        cm["metadata"]["labels"]["app.kubernetes.io/part-of"],
        "agentrun"
    );
    let shipped: Value =
        serde_json::from_str(cm["data"]["agentrun.json"].as_str().unwrap()).expect("JSON");
    assert_eq!(shipped, dashboard(), "the ConfigMap holds {DASHBOARD}");

    // Label, value, namespace, labels and annotations are configurable.
    let objs = render(&with_store(json!({"grafana": {"dashboard": {
        "enabled": true,
        "label": "example.com/dashboard",
        "labelValue": "agentrun",
        "namespace": "monitoring",
        "labels": {"team": "ml"},
        "annotations": {"grafana_folder": "agentrun"}
    }}})))
    .expect("renders");
    let cms = dashboard_configmaps(&objs);
    assert_eq!(cms.len(), 1);
    let meta = &cms[0]["metadata"];
    assert_eq!(meta["namespace"], "monitoring");
    assert_eq!(meta["labels"]["example.com/dashboard"], "agentrun");
    assert!(meta["labels"].get("grafana_dashboard").is_none(), "{meta}");
    assert_eq!(meta["labels"]["team"], "ml");
    assert_eq!(meta["annotations"]["grafana_folder"], "agentrun");

    // lint --strict passes with it on.
    let values = with_store(json!({"grafana": {"dashboard": {"enabled": true}}}));
    let (ok, stdout, stderr) = helm_lint(&values);
    assert!(ok, "helm lint:\n{stdout}\n{stderr}");
}

#[test]
fn the_values_schema_refuses_wrong_dashboard_values() {
    for (dashboard, field) in [
        (json!({"enabled": "yes"}), "enabled"),
        (json!({"enabled": true, "label": "not a label"}), "label"),
        (json!({"enabled": true, "labelValue": 1}), "labelValue"),
        (
            json!({"enabled": true, "namespace": "Not_A_Namespace"}),
            "namespace",
        ),
        (json!({"enabeld": true}), "enabeld"),
    ] {
        let values = with_store(json!({"grafana": {"dashboard": dashboard}}));
        match render(&values) {
            Ok(_) => panic!("{values} was accepted"),
            Err(e) => assert!(
                e.contains(field),
                "{values}: error does not name {field:?}: {e}"
            ),
        }
    }
}
