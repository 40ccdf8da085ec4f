//! placeholder
pub fn router() -> axum::Router {
    axum::Router::new()
}
