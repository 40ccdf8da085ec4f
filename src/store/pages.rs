//! Reading a log by pages of bytes, within a process's budget.
//!
//! A log's records are each bounded (the gateway takes no body over
//! 16 MiB), but a log is not: a run may hold a hundred records of
//! megabytes. Whoever reads a log whole in one process (the reconciler
//! replaying or verifying it, the log API, the gateway) reads it a page at
//! a time ([`super::PAGE_BYTES`] of stored bodies, or one larger record),
//! and holds a page only with a ticket from its [`ReadBudget`]: what a
//! process holds of logs being read is at most its budget, however many
//! runs, requests and records there are.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{Head, Record, StepStore, StoreError, verify_stored};

/// The most one page holds: [`super::PAGE_BYTES`] of bodies, or one record
/// as large as a step pod may append (the gateway's body limit).
pub const PAGE_HELD: usize = 16 << 20;

/// How many pages a process (or one of its parts) holds at once.
#[derive(Clone, Debug)]
pub struct ReadBudget {
    pages: Arc<Semaphore>,
}

/// Leave to hold one page; the page is let go with it.
pub type PageTicket = OwnedSemaphorePermit;

impl ReadBudget {
    /// A budget of `bytes`: that many bytes of pages, one page at least.
    pub fn new(bytes: usize) -> ReadBudget {
        ReadBudget {
            pages: Arc::new(Semaphore::new((bytes / PAGE_HELD).max(1))),
        }
    }

    /// The pages this budget holds at once.
    pub fn pages(&self) -> usize {
        self.pages.available_permits()
    }

    /// Leave to read and hold one page, once one is free.
    pub async fn page(&self) -> PageTicket {
        self.pages
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed")
    }

    /// [`ReadBudget::page`], or `None` after `wait` (the caller answers busy).
    pub async fn page_within(&self, wait: Duration) -> Option<PageTicket> {
        tokio::time::timeout(wait, self.page()).await.ok()
    }
}

/// A run's log past a verified head, read a page at a time, each page
/// verified from its stored bytes as the continuation of the one before.
pub struct Pages<'a> {
    store: &'a dyn StepStore,
    budget: &'a ReadBudget,
    run: &'a str,
    head: Head,
}

impl<'a> Pages<'a> {
    /// The records of `run` after `head` (already verified).
    pub fn after(
        store: &'a dyn StepStore,
        budget: &'a ReadBudget,
        run: &'a str,
        head: Head,
    ) -> Pages<'a> {
        Pages {
            store,
            budget,
            run,
            head,
        }
    }

    /// The head the pages read so far reach.
    pub fn head(&self) -> Head {
        self.head
    }

    /// The next page, with the ticket that lets it be held; `None` at the
    /// end. A record that does not verify is [`StoreError::ChainBroken`].
    pub async fn next(&mut self) -> Result<Option<(Vec<Record>, PageTicket)>, StoreError> {
        let ticket = self.budget.page().await;
        let stored = self
            .store
            .read_stored_page(self.run, self.head.len, None, super::PAGE_BYTES)
            .await?;
        if stored.is_empty() {
            return Ok(None);
        }
        let mut records = Vec::with_capacity(stored.len());
        for s in &stored {
            let record = verify_stored(self.run, &self.head, s)?;
            self.head = record.head();
            records.push(record);
        }
        Ok(Some((records, ticket)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{RecordDraft, SqliteStore, StepKind};

    async fn log_of(dir: &std::path::Path, sizes: &[usize]) -> (SqliteStore, Vec<Record>) {
        let url = format!("sqlite://{}", dir.join("log.db").display());
        let store = SqliteStore::open(&url, &Default::default()).await.unwrap();
        let lease = store
            .acquire("r", "w", Duration::from_secs(60))
            .await
            .unwrap();
        let mut head = Head::EMPTY;
        let mut out = Vec::new();
        for (i, size) in sizes.iter().enumerate() {
            let draft = RecordDraft::new(
                StepKind::ToolResult,
                serde_json::json!({"i": i, "text": "x".repeat(*size)}),
            );
            let record = draft.seal(&head).unwrap();
            let stored = store.append("r", lease.epoch, &record).await.unwrap();
            head = stored.head();
            out.push(stored);
        }
        (store, out)
    }

    #[tokio::test]
    async fn a_page_comes_to_its_bytes_or_one_larger_record() {
        let mb = 1 << 20;
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = log_of(dir.path(), &[mb, mb, mb, 5 * mb, mb, 10]).await;
        let seqs =
            |page: Vec<crate::store::StoredRecord>| page.iter().map(|r| r.seq).collect::<Vec<_>>();
        let page = store
            .read_stored_page("r", 0, None, 3 * mb + 3000)
            .await
            .unwrap();
        assert_eq!(seqs(page), [0, 1, 2]);
        let page = store.read_stored_page("r", 3, None, 3 * mb).await.unwrap();
        assert_eq!(
            seqs(page),
            [3],
            "a record over the page is a page of its own"
        );
        let page = store.read_stored_page("r", 4, None, 3 * mb).await.unwrap();
        assert_eq!(seqs(page), [4, 5]);
        let page = store
            .read_stored_page("r", 4, Some(5), 3 * mb)
            .await
            .unwrap();
        assert_eq!(seqs(page), [4], "`to` ends it too");
        assert!(
            store
                .read_stored_page("r", 6, None, mb)
                .await
                .unwrap()
                .is_empty()
        );
    }

    #[tokio::test]
    async fn pages_read_a_log_whole_verified_and_hold_a_budget_ticket_each() {
        let dir = tempfile::tempdir().unwrap();
        let (store, log) = log_of(dir.path(), &[3 << 20, 3 << 20, 3 << 20, 10]).await;
        let budget = ReadBudget::new(PAGE_HELD);
        let mut pages = Pages::after(&store, &budget, "r", Head::EMPTY);
        let mut read = Vec::new();
        while let Some((page, _ticket)) = pages.next().await.unwrap() {
            assert_eq!(budget.pages(), 0, "a page is held with its ticket");
            assert!(page.len() <= 2, "4 MiB pages of 3 MiB records");
            read.extend(page);
        }
        assert_eq!(budget.pages(), 1);
        assert_eq!(read, log);
        assert_eq!(pages.head(), log.last().unwrap().head());
    }

    #[tokio::test]
    async fn a_page_of_a_record_altered_in_the_database_is_a_broken_chain() {
        let dir = tempfile::tempdir().unwrap();
        let (store, log) = log_of(dir.path(), &[10, 10, 10]).await;
        // Record 1's text rewritten and its hash recomputed from its own
        // bytes: only the link to it from record 2 is left to notice.
        let mut forged = log[1].clone();
        forged.payload["text"] = "refund approved".into();
        sqlx::query("DROP TRIGGER agentrun_steps_no_update")
            .execute(store.pool())
            .await
            .unwrap();
        sqlx::query("UPDATE agentrun_steps SET body = ?, hash = ? WHERE run = 'r' AND seq = 1")
            .bind(String::from_utf8(forged.canonical_bytes()).unwrap())
            .bind(forged.compute_hash().0.to_vec())
            .execute(store.pool())
            .await
            .unwrap();
        let budget = ReadBudget::new(PAGE_HELD);
        let mut pages = Pages::after(&store, &budget, "r", Head::EMPTY);
        let err = pages.next().await.expect_err("the altered record fails");
        assert!(
            matches!(err, StoreError::ChainBroken { seq: 2, .. }),
            "{err}"
        );
    }
}
