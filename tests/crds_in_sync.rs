//! `crds/crds.yaml` must be exactly what `agentrun crds` prints, so GitOps
//! users and the chart install the schema the code was built with.

#[test]
fn checked_in_crds_match_the_generator() {
    let generated = agentrun::api::crds_yaml().expect("CRDs serialize");
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/crds/crds.yaml");
    let checked_in = std::fs::read_to_string(path).expect("crds/crds.yaml exists");
    assert!(
        generated == checked_in,
        "crds/crds.yaml is out of date: run `cargo run --bin agentrun -- crds > crds/crds.yaml`"
    );
}

#[test]
fn every_crd_has_status_printer_columns_short_names_and_category() {
    for crd in agentrun::api::crds() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let version = &crd.spec.versions[0];
        // Policies are read by runs, not reconciled: they have no status.
        let policy = crd.spec.names.kind.ends_with("AgentPolicy");
        assert!(
            policy
                || version
                    .subresources
                    .as_ref()
                    .and_then(|s| s.status.as_ref())
                    .is_some(),
            "{name}: status subresource"
        );
        assert!(
            version
                .additional_printer_columns
                .as_ref()
                .is_some_and(|c| c.len() >= 3),
            "{name}: printer columns"
        );
        assert!(
            crd.spec
                .names
                .short_names
                .as_ref()
                .is_some_and(|s| !s.is_empty()),
            "{name}: short names"
        );
        assert_eq!(
            crd.spec.names.categories.as_deref(),
            Some(&["agentrun-all".to_string()][..]),
            "{name}: category"
        );
    }
}

/// `kubectl get NAME` resolves a category before a singular name: a category
/// equal to any of our resource names would hijack it (and `delete NAME --all`).
#[test]
fn no_category_shadows_a_resource_name() {
    let crds = agentrun::api::crds();
    let mut names = Vec::new();
    for crd in &crds {
        let n = &crd.spec.names;
        names.push(n.plural.clone());
        names.push(n.kind.to_lowercase());
        names.extend(n.singular.clone());
        names.extend(n.short_names.clone().unwrap_or_default());
    }
    for crd in &crds {
        for category in crd.spec.names.categories.iter().flatten() {
            assert!(
                !names.contains(category),
                "category {category} shadows a resource name"
            );
        }
    }
}
