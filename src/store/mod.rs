//! The step log (DESIGN.md section 3).
