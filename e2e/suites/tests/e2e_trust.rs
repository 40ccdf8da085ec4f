//! Trust boundaries (issue 10, DESIGN.md section 9): each attack a run
//! creator, a namespace user, an approver or a model reply could try, played
//! against the local control plane as that user, asserting that it is refused,
//! that no tool side effect happened and that the run's log still verifies.

mod common;

#[path = "trust/admission.rs"]
mod admission;
#[path = "trust/approvals.rs"]
mod approvals;
#[path = "trust/discovery.rs"]
mod discovery;
#[path = "trust/duties.rs"]
mod duties;
#[path = "trust/egress.rs"]
mod egress;
#[path = "trust/gates.rs"]
mod gates;
#[path = "trust/gitops.rs"]
mod gitops;
#[path = "trust/keys.rs"]
mod keys;
#[path = "trust/servers.rs"]
mod servers;
#[path = "trust/store.rs"]
mod store;
#[path = "trust/timing.rs"]
mod timing;
#[path = "trust/upgrade.rs"]
mod upgrade;
