//! Trust attacks: store. Filled in by the work on issue 10.
