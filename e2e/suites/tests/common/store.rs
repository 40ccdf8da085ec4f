//! The PostgreSQL step store the e2e tests use: the instance of `e2e/postgres`
//! (started here if it is not running), database `agentrun_e2e`, migrated once.

use std::process::Command;
use std::sync::OnceLock;

use sqlx::Connection;

/// Runs `e2e/postgres ARG` and returns its stdout; fails loudly.
pub fn e2e_postgres(arg: &str) -> String {
    e2e_postgres_env(arg, &[])
}

/// `e2e/postgres ARG` with extra environment (another instance).
fn e2e_postgres_env(arg: &str, env: &[(&str, &str)]) -> String {
    super::scripts::e2e_script(
        "postgres",
        arg,
        env,
        "PostgreSQL is required for these tests",
    )
}

/// Superuser URL of the shared test instance (started once per process).
pub fn pg_admin_url() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        e2e_postgres("up");
        e2e_postgres("url")
    })
}

/// URL of the migrated e2e database; the controller and step pods use it.
pub async fn e2e_store_url() -> String {
    static READY: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();
    READY
        .get_or_init(|| async {
            let admin = pg_admin_url();
            let mut conn = sqlx::PgConnection::connect(admin)
                .await
                .expect("connecting to PostgreSQL");
            let exists: Option<(i32,)> =
                sqlx::query_as("SELECT 1 FROM pg_database WHERE datname = 'agentrun_e2e'")
                    .fetch_optional(&mut conn)
                    .await
                    .expect("querying databases");
            if exists.is_none() {
                // Another test binary may create it at the same moment: that is fine.
                let _ = sqlx::raw_sql("CREATE DATABASE agentrun_e2e")
                    .execute(&mut conn)
                    .await;
            }
            let mut url = url::Url::parse(admin).expect("admin URL");
            url.set_path("/agentrun_e2e");
            let url = url.to_string();
            let store = agentrun::store::open(&url)
                .await
                .expect("opening the e2e store");
            store.migrate().await.expect("migrating the e2e store");
            url
        })
        .await
        .clone()
}

/// URL of database `name` on the shared test instance, created and
/// migrated if needed (the scale benchmark's own database, so that its
/// table statistics count its own controller's reads only).
pub async fn migrated_database_url(name: &str) -> String {
    let admin = pg_admin_url();
    let mut conn = sqlx::PgConnection::connect(admin)
        .await
        .expect("connecting to PostgreSQL");
    let exists: Option<(i32,)> = sqlx::query_as("SELECT 1 FROM pg_database WHERE datname = $1")
        .bind(name)
        .fetch_optional(&mut conn)
        .await
        .expect("querying databases");
    if exists.is_none() {
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await;
    }
    let mut url = url::Url::parse(admin).expect("admin URL");
    url.set_path(&format!("/{name}"));
    let url = url.to_string();
    let store = agentrun::store::open(&url)
        .await
        .unwrap_or_else(|e| panic!("opening database {name}: {e}"));
    store
        .migrate()
        .await
        .unwrap_or_else(|e| panic!("migrating database {name}: {e}"));
    store.close().await;
    url
}

/// A PostgreSQL instance of its own (`e2e/postgres` with another name and
/// port), for a test that stops and starts it; removed when dropped.
pub struct PrivatePostgres {
    name: String,
    port: u16,
}

impl PrivatePostgres {
    /// Starts the instance and returns it with a migrated store URL.
    pub async fn up(name: &str, port: u16) -> (PrivatePostgres, String) {
        let pg = PrivatePostgres {
            name: name.into(),
            port,
        };
        pg.run("up");
        let url = pg.run("url");
        let store = agentrun::store::open(&url)
            .await
            .expect("opening the private store");
        store.migrate().await.expect("migrating the private store");
        store.close().await;
        (pg, url)
    }

    /// `e2e/postgres ARG` for this instance.
    pub fn run(&self, arg: &str) -> String {
        let port = self.port.to_string();
        e2e_postgres_env(
            arg,
            &[
                ("AGENTRUN_PG_NAME", &self.name),
                ("AGENTRUN_PG_PORT", &port),
            ],
        )
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let script = super::root().join("e2e/postgres");
        let _ = Command::new("bash")
            .arg(&script)
            .arg("down")
            .env("AGENTRUN_PG_NAME", &self.name)
            .env("AGENTRUN_PG_PORT", self.port.to_string())
            .output();
    }
}
