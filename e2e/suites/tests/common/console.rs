//! The console under test: `kubectl agentrun console` as a user (loopback),
//! `agentrun console` in its in-cluster mode, and a real headless Chromium
//! driven through chromedriver (WebDriver, `fantoccini`), finding elements
//! the way a person does: by visible text and labels.

use std::io::BufRead as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client as Browser, ClientBuilder, Locator};

pub const CHROMIUM: &str = "/usr/bin/chromium";
pub const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// A console process (killed on drop) and the URL it printed.
pub struct ConsoleProcess {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The URL with the ticket that opens its one session (loopback only).
    pub session_url: String,
}

impl Drop for ConsoleProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ConsoleProcess {
    /// `kubectl agentrun console` as `user` (its kubeconfig context) in
    /// `namespace`, the controller's keys in `namespace` too.
    pub fn loopback(user: &str, namespace: &str) -> ConsoleProcess {
        let mut child = Command::new(crate::common::binary("kubectl-agentrun"))
            .args(["--context", user, "-n", namespace, "console"])
            .args(["--controller-namespace", namespace])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting kubectl-agentrun console");
        let stdout = child.stdout.take().unwrap();
        let mut out = std::io::BufReader::new(stdout);
        let mut line = String::new();
        out.read_line(&mut line).expect("reading the console's URL");
        // The rest is read and dropped: the console's stdout stays open.
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        let url = line
            .trim()
            .strip_prefix("agentrun console: ")
            .unwrap_or_else(|| panic!("the console printed no URL: {line:?}"))
            .to_string();
        let base = url.split("/?").next().unwrap().to_string();
        ConsoleProcess {
            child,
            base,
            session_url: url,
        }
    }

    /// `agentrun console` in its in-cluster mode on a free loopback port:
    /// the API server at `api_server` (CA in `ca_file`), namespaces to look
    /// in, every request as the bearer token it carries.
    pub fn in_cluster(
        api_server: &str,
        ca_file: &std::path::Path,
        namespace: &str,
    ) -> ConsoleProcess {
        let port = crate::common::ports::reserve();
        let base = format!("http://127.0.0.1:{port}");
        let child = Command::new(crate::common::binary("agentrun"))
            // No kubeconfig to fall back on: only the forwarded tokens.
            .env_remove("KUBECONFIG")
            .args(["console", "--listen", &format!("127.0.0.1:{port}")])
            .args(["--public-url", &base, "--api-server", api_server])
            .args(["--ca-file", ca_file.to_str().unwrap()])
            .args([
                "--namespace",
                namespace,
                "--controller-namespace",
                namespace,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting agentrun console");
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "agentrun console did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        ConsoleProcess {
            child,
            base,
            session_url: String::new(),
        }
    }

    /// `host:port`.
    pub fn host(&self) -> String {
        self.base.trim_start_matches("http://").to_string()
    }
}

/// The `name=value` of the session cookie a response sets.
pub fn session_cookie_of(res: &reqwest::Response) -> String {
    let set = res.headers()["set-cookie"].to_str().unwrap();
    set.split(';').next().unwrap().to_string()
}

/// A plain HTTP client that follows no redirect (the tests look at them).
pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// The anti-forgery token a page carries (`<meta name="agentrun-csrf">`).
pub fn csrf_of(page: &str) -> String {
    let at = page
        .find("name=\"agentrun-csrf\" content=\"")
        .unwrap_or_else(|| panic!("no anti-forgery token in the page: {page}"));
    let rest = &page[at + "name=\"agentrun-csrf\" content=\"".len()..];
    rest[..rest.find('"').unwrap()].to_string()
}

/// Where screenshots go: `$CARGO_TARGET_DIR/e2e-artifacts/console` (or
/// `target/...`).
pub fn artifacts() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::common::root().join("target"));
    let dir = target.join("e2e-artifacts").join("console");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Headless Chromium through its own chromedriver (both killed on drop).
pub struct Chrome {
    driver: Child,
    pub browser: Browser,
}

impl Drop for Chrome {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Chrome {
    /// Starts chromedriver and a headless Chromium session. Fails (never
    /// skips) when they are not installed: `e2e/install-deps` installs them.
    pub async fn start() -> Chrome {
        for (path, what) in [(CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")] {
            assert!(
                std::path::Path::new(path).exists(),
                "{path} is missing: the console's browser tests need Debian's `{what}` \
                 (run e2e/install-deps, or apt-get install -y chromium chromium-driver)"
            );
        }
        let port = crate::common::ports::reserve();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting chromedriver");
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "chromedriver did not listen"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": CHROMIUM,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1400,1100", "--lang=en-US"]
            }),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let browser = ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
            .expect("a WebDriver session with headless Chromium");
        Chrome { driver, browser }
    }

    /// Saves a screenshot of the whole page as `NAME.png` in [`artifacts`].
    /// The `Cookie` header of `console`'s session as this browser holds it
    /// (WebDriver reads HttpOnly cookies too).
    pub async fn session_cookie(&self, console: &ConsoleProcess) -> String {
        let port = console.base.rsplit(':').next().unwrap();
        let name = format!("agentrun_console_{port}");
        let cookie = self
            .browser
            .get_named_cookie(&name)
            .await
            .unwrap_or_else(|e| panic!("the browser holds no cookie {name}: {e}"));
        format!("{name}={}", cookie.value())
    }

    pub async fn screenshot(&self, name: &str) -> PathBuf {
        // The whole page: the window as tall as the document.
        let height = self
            .browser
            .execute("return Math.max(document.body.scrollHeight, 800);", vec![])
            .await
            .ok()
            .and_then(|v| v.as_u64())
            .unwrap_or(1100)
            .min(6000);
        let _ = self
            .browser
            .set_window_size(1400, height as u32 + 140)
            .await;
        let png = self.browser.screenshot().await.expect("screenshot");
        let path = artifacts().join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap();
        let _ = self.browser.set_window_size(1400, 1100).await;
        path
    }

    /// The page's visible text.
    /// Empty while a navigation has no document yet (callers wait on text).
    pub async fn text(&self) -> String {
        match self.browser.find(Locator::Css("body")).await {
            Ok(body) => body.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// Waits until the page's visible text contains `what`.
    pub async fn wait_text(&self, what: &str, within: Duration) -> String {
        let started = Instant::now();
        loop {
            let text = self.text().await;
            if text.contains(what) {
                return text;
            }
            if started.elapsed() > within {
                panic!("the page never showed {what:?}; it shows:\n{text}");
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// Clicks the link whose visible text is `text`.
    pub async fn click_link(&self, text: &str) {
        self.browser
            .find(Locator::LinkText(text))
            .await
            .unwrap_or_else(|e| panic!("no link {text:?}: {e}"))
            .click()
            .await
            .unwrap();
    }

    /// Clicks the button whose visible text is `text`.
    pub async fn click_button(&self, text: &str) {
        self.browser
            .find(Locator::XPath(&format!(
                "//button[normalize-space()={}]",
                xpath_string(text)
            )))
            .await
            .unwrap_or_else(|e| panic!("no button {text:?}: {e}"))
            .click()
            .await
            .unwrap();
    }

    /// Whether a button with visible text `text` is on the page.
    pub async fn has_button(&self, text: &str) -> bool {
        self.browser
            .find_all(Locator::XPath(&format!(
                "//button[normalize-space()={}]",
                xpath_string(text)
            )))
            .await
            .map(|v| !v.is_empty())
            .unwrap_or(false)
    }

    /// Types `value` into the field labelled `label` (replacing its value).
    pub async fn fill(&self, label: &str, value: &str) {
        let xpath = format!(
            "//*[@id=//label[normalize-space()={}]/@for]",
            xpath_string(label)
        );
        let field = self
            .browser
            .find(Locator::XPath(&xpath))
            .await
            .unwrap_or_else(|e| panic!("no field labelled {label:?}: {e}"));
        field.clear().await.unwrap();
        field.send_keys(value).await.unwrap();
    }
}

/// An XPath string literal of `s`.
fn xpath_string(s: &str) -> String {
    if !s.contains('\'') {
        format!("'{s}'")
    } else {
        format!("concat('{}')", s.replace('\'', "', \"'\", '"))
    }
}

/// A form body (`application/x-www-form-urlencoded`), as a browser sends it.
pub trait FormBody {
    fn form_pairs<K: AsRef<str>, V: AsRef<str>>(self, pairs: &[(K, V)]) -> Self;
}

impl FormBody for reqwest::RequestBuilder {
    fn form_pairs<K: AsRef<str>, V: AsRef<str>>(self, pairs: &[(K, V)]) -> Self {
        let mut s = url::form_urlencoded::Serializer::new(String::new());
        for (k, v) in pairs {
            s.append_pair(k.as_ref(), v.as_ref());
        }
        self.header("content-type", "application/x-www-form-urlencoded")
            .body(s.finish())
    }
}
