//! Tools the agent calls (DESIGN.md sections 4 and 7).
