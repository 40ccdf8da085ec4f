//! Image names as the node reads them: it runs no images, it maps an image to
//! the binaries built for it.

/// The image repository's last path component: `registry.example/x/agentrun:0.1` → `agentrun`.
pub fn image_name(image: &str) -> &str {
    let image = image.split('@').next().unwrap_or(image);
    let last = image.rsplit('/').next().unwrap_or(image);
    last.split(':').next().unwrap_or(last)
}
