//! Model providers (DESIGN.md section 7).
