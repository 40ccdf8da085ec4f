//! Trust attacks: admission. Filled in by the work on issue 10.
use super::common as _;
