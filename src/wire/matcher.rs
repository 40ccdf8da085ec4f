//! Which recorded answer a request gets on replay.
