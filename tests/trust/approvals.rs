//! Trust attacks: approvals. Filled in by the work on issue 10.
