//! The plugin's own verification of a run's log, record by record as it
//! arrives: every record hashes right and links to the one before, every
//! controller record carries a signature the published keys accept, and
//! the log reaches (a finished run's: ends at) the head the run's status
//! recorded. Whatever served the records, a log that does not pass is never
//! called verified, and the records that fail are named.
//!
//! Pure: the commands in `super` fetch the records, the run and the keys.

use std::collections::{BTreeMap, BTreeSet};

use crate::api::runlog::{RunLog, VERIFIED, Verification};
use crate::api::{AgentRun, Phase};
use crate::refusal::Refusal;
use crate::store::audit::{Audit, SignedRecord};
use crate::store::{
    Hash, Head, KeyWindows, ParseHashError, Record, RecordVerifier, SignatureRules, StoredRecord,
    UnreadableRecord,
};

/// A head recorded for the run that is no hash: nothing to check against.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("status.log.headHash")]
    StatusHead(#[source] ParseHashError),
    #[error("the log API's verification.headHash")]
    ServedHead(#[source] ParseHashError),
}

/// What a log is checked against: the run's identity and the head its
/// status recorded.
#[derive(Clone, Debug, PartialEq)]
pub struct Trust {
    /// The run's uid (controller signatures are bound to it); `None` until
    /// a log page names it, when the run itself could not be read.
    pub uid: Option<String>,
    /// `status.log` (length, headHash): the log must reach it. `None`
    /// while no head is recorded.
    pub anchor: Option<Head>,
    /// `status.phase`, when there is one.
    pub phase: Option<String>,
    /// The phase is final: nothing is appended after the recorded head, so
    /// the log must end exactly there.
    pub terminal: bool,
    pub rules: SignatureRules,
    /// Where the head came from: the AgentRun (`None`), or the log API's own
    /// word (the reason the run could not be read).
    pub secondhand: Option<String>,
}

impl Trust {
    /// From the AgentRun, read from the API server with the user's identity.
    pub fn of_run(run: &AgentRun) -> Result<Trust, TrustError> {
        let status = run.status.as_ref();
        let log = status.and_then(|s| s.log.as_ref());
        let anchor = match log.and_then(|l| l.head_hash.as_deref()) {
            Some(hash) => Some(Head {
                len: log.map_or(0, |l| l.length),
                hash: hash.parse().map_err(TrustError::StatusHead)?,
            }),
            None => None,
        };
        let phase = status.and_then(|s| s.phase);
        Ok(Trust {
            uid: run.metadata.uid.clone(),
            anchor,
            phase: phase.map(|p| phase_name(&p)),
            terminal: phase.is_some_and(Phase::is_terminal),
            rules: crate::api::signing::signature_rules(run),
            secondhand: None,
        })
    }

    /// From what the log API says of the run, for a user who may read its
    /// log but not the run (`why`). The head is then the serving replica's
    /// word; signatures are checked strictly (every controller record
    /// signed and bound), as the run's own exemptions are not known, with
    /// the key windows the server read in the run's status (none: no
    /// retired key's signature counts).
    pub fn of_log(log: &RunLog, why: &str) -> Result<Trust, TrustError> {
        let v = log.verification.as_ref();
        let anchor = match v.and_then(|v| v.head_hash.as_deref()) {
            Some(hash) => Some(Head {
                len: v.map_or(0, |v| v.head_length),
                hash: hash.parse().map_err(TrustError::ServedHead)?,
            }),
            None => None,
        };
        let phase = log.run.phase.clone();
        // The key windows are the server's word too: a page without them
        // lets no retired key's signature count; a follow event, which says
        // nothing of the run's status, bounds them no more than its head.
        let keys = match v {
            None => KeyWindows::Unrecorded,
            Some(v) => v
                .signing_keys
                .as_deref()
                .map(crate::api::signing::windows_of)
                .unwrap_or(SignatureRules::STRICT.keys),
        };
        // Without the server's head, a final phase cannot say where the log
        // must end.
        let terminal = v.is_some()
            && phase
                .as_deref()
                .and_then(parse_phase)
                .is_some_and(Phase::is_terminal);
        Ok(Trust {
            uid: log.metadata.uid.clone(),
            anchor,
            phase,
            terminal,
            rules: SignatureRules {
                keys,
                ..SignatureRules::STRICT
            },
            secondhand: Some(why.to_string()),
        })
    }
}

fn phase_name(p: &Phase) -> String {
    match serde_json::to_value(p) {
        Ok(serde_json::Value::String(s)) => s,
        _ => format!("{p:?}"),
    }
}

/// A phase as `status.phase` spells it.
pub fn parse_phase(s: &str) -> Option<Phase> {
    serde_json::from_value(serde_json::Value::String(s.to_string())).ok()
}

/// Pages of `get`, put together: each starts where the one before ended
/// and belongs to the same run, or it is refused (a server that repeats or
/// skips records is not shown as if it had not).
#[derive(Default)]
pub struct Pages {
    /// The records as stored (verified by [`judge`]).
    pub records: Vec<StoredRecord>,
    /// The last page, without its records (the run's state as last read).
    pub last: Option<RunLog>,
    /// The first page the server's own check failed on.
    pub failed: Option<Verification>,
}

impl Pages {
    /// Adds a page; returns the token of the next one, `None` after the last.
    pub fn push(&mut self, mut page: RunLog) -> Result<Option<String>, Refusal> {
        let start = self.records.len() as u64;
        if let Some(before) = &self.last {
            same_run(before, &page)?;
        }
        in_sequence(start, &page.records)?;
        let received = page.records.len() as u64;
        let token = match &page.page {
            Some(p) => {
                if p.from_seq != start || p.next_seq != start + received {
                    return Err(Refusal::new(format!(
                        "the log API sent a page said to hold seq {}..{} where seq {start} was due, with {received} records: refusing it",
                        p.from_seq, p.next_seq
                    )));
                }
                p.r#continue.clone()
            }
            None => None,
        };
        if token.is_some() && received == 0 {
            return Err(Refusal::new(format!(
                "the log API sent an empty page at seq {start} with a next one: refusing to loop"
            )));
        }
        self.records.append(&mut page.records);
        if self.failed.is_none() {
            self.failed = page.verification.clone().filter(|v| v.result != VERIFIED);
        }
        self.last = Some(page);
        Ok(token)
    }
}

/// Refuses a page or event of another run than the ones before (the run
/// was deleted and created again under its name while it was read).
pub fn same_run(before: &RunLog, now: &RunLog) -> Result<(), Refusal> {
    match (&before.metadata.uid, &now.metadata.uid) {
        (Some(a), Some(b)) if a != b => Err(Refusal::new(format!(
            "the log API switched runs while the log was read (uid {a}, then {b}): the run was replaced"
        ))),
        _ => Ok(()),
    }
}

/// Refuses records that are not exactly `start`, `start + 1`, ...
pub fn in_sequence(start: u64, records: &[StoredRecord]) -> Result<(), Refusal> {
    for (i, r) in records.iter().enumerate() {
        let due = start + i as u64;
        if r.seq != due {
            let what = if r.seq < due { "repeats" } else { "skips to" };
            return Err(Refusal::new(format!(
                "the log API {what} seq {} where seq {due} was due: refusing the records from there",
                r.seq
            )));
        }
    }
    Ok(())
}

/// Checks records one at a time, in seq order from 0.
pub struct Checker {
    uid: String,
    keys: Result<RecordVerifier, Refusal>,
    rules: SignatureRules,
    /// The head of what was received (the stored hashes, checked or not).
    head: Head,
    /// Every received record's stored hash, by seq, for the recorded heads.
    hashes: Vec<Hash>,
    /// Heads the run's status recorded (each must be reached).
    anchors: Vec<Head>,
    /// The final head of a finished run (the log must end there).
    end: Option<Head>,
    /// The records' own problems (hash, link, signature), by seq.
    problems: BTreeMap<u64, Vec<String>>,
    signed: Vec<SignedRecord>,
    /// Problems about the log as a whole (records missing, keys unread...).
    global: Vec<String>,
    notes: Vec<String>,
}

impl Checker {
    /// Checks run `uid`'s log with the controller's published `keys`.
    pub fn new(uid: &str, keys: Result<RecordVerifier, Refusal>, trust: &Trust) -> Checker {
        let mut c = Checker {
            uid: uid.to_string(),
            keys,
            rules: trust.rules.clone(),
            head: Head::EMPTY,
            hashes: Vec::new(),
            anchors: Vec::new(),
            end: None,
            problems: BTreeMap::new(),
            signed: Vec::new(),
            global: Vec::new(),
            notes: Vec::new(),
        };
        c.expect(trust);
        c
    }

    /// The seq the next record must have.
    pub fn next_seq(&self) -> u64 {
        self.head.len
    }

    /// Adds what the run's status says now (a later status when following).
    pub fn expect(&mut self, trust: &Trust) {
        self.rules = trust.rules.clone();
        if let Some(a) = trust.anchor
            && a.len > 0
            && !self.anchors.contains(&a)
        {
            self.anchors.push(a);
        }
        // A finished run's recorded head is its log's end (a run that
        // finished without one, e.g. refused before it started, has none to
        // compare with).
        if trust.terminal
            && let Some(a) = trust.anchor
        {
            self.end = Some(a);
        }
        if let Some(why) = &trust.secondhand {
            let note = format!(
                "the head checked is the log API's word, not the run's status ({why}); signatures were checked strictly"
            );
            if !self.notes.contains(&note) {
                self.notes.push(note);
            }
        }
    }

    /// A problem of the whole log (not of one record).
    pub fn fail(&mut self, problem: String) {
        if !self.global.contains(&problem) {
            self.global.push(problem);
        }
    }

    /// Takes the next record, as stored; returns what it decodes to and
    /// what is wrong with it (empty when nothing is). A record not at the
    /// next seq is refused: nothing after a repeat or a gap can be placed.
    pub fn take(&mut self, s: &StoredRecord) -> Result<Taken, Refusal> {
        in_sequence(self.head.len, std::slice::from_ref(s))?;
        let mut wrong = Vec::new();
        // One record at a time, from the stored head before it: an altered
        // record is named alone, the ones after it still link to its stored
        // hash.
        let record = match crate::store::verify_stored(&self.uid, &self.head, s) {
            Ok(r) => Some(r),
            Err(e) => {
                wrong.push(chain_reason(&e));
                shown(s)
            }
        };
        if let (Ok(keys), Some(r)) = (&self.keys, &record)
            && let Some(check) = keys.classify(&self.uid, r, &self.rules)
        {
            if !check.accepted() {
                wrong.push(format!("the {} record's {check}", r.kind));
            }
            self.signed.push(SignedRecord {
                seq: r.seq,
                kind: r.kind,
                check,
            });
        }
        if !wrong.is_empty() {
            self.problems.insert(s.seq, wrong.clone());
        }
        self.head = Head {
            len: s.seq + 1,
            hash: s.hash,
        };
        self.hashes.push(s.hash);
        // Against the heads known now; `verdict` checks them all again.
        wrong.extend(self.head_problems_at(s.seq));
        Ok(Taken { record, wrong })
    }

    /// What the recorded heads say of the record at `seq`.
    fn head_problems_at(&self, seq: u64) -> Vec<String> {
        let mut out = Vec::new();
        let hash = self.hashes[seq as usize];
        for a in self.anchors.iter().chain(self.end.iter()) {
            if a.len == seq + 1 && a.hash != hash {
                out.push(format!(
                    "its hash is {hash} but the run's status records the head {} here: the log was rewritten",
                    a.hash
                ));
            }
        }
        if let Some(end) = self.end
            && seq >= end.len
        {
            out.push(format!(
                "past the head the finished run recorded (length {}): not part of its log",
                end.len
            ));
        }
        out.dedup();
        out
    }

    /// Problems of the log as a whole against the recorded heads.
    fn head_problems(&self) -> Vec<String> {
        let received = self.hashes.len() as u64;
        let mut out = Vec::new();
        for a in self.anchors.iter().chain(self.end.iter()) {
            if a.len > received {
                out.push(format!(
                    "the run's status records {} records (head {}) but {received} were received: records are missing",
                    a.len, a.hash
                ));
            }
        }
        out.dedup();
        out
    }

    /// The verdict on everything taken so far.
    pub fn verdict(&self) -> Verdict {
        let mut by_seq: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
        for (seq, wrong) in &self.problems {
            by_seq
                .entry(*seq)
                .or_default()
                .extend(wrong.iter().cloned());
        }
        for seq in 0..self.hashes.len() as u64 {
            for p in self.head_problems_at(seq) {
                by_seq.entry(seq).or_default().insert(p);
            }
        }
        let mut global = self.global.clone();
        if let Err(e) = &self.keys {
            global.push(format!("the controller's signatures were not checked: {e}"));
        }
        global.extend(self.head_problems());
        Verdict {
            head: self.head,
            marked: by_seq
                .into_iter()
                .map(|(seq, p)| (seq, p.into_iter().collect()))
                .collect(),
            global,
            signed: self.signed.clone(),
            anchored: self.anchored(),
            notes: self.notes.clone(),
        }
    }

    /// How the log stands to the recorded heads, for a verified log.
    fn anchored(&self) -> String {
        let last = self.anchors.iter().max_by_key(|a| a.len);
        match (last, self.end) {
            (_, Some(end)) => format!("ends at the recorded head {}", end.hash),
            (None, None) => "no head recorded in the status yet".into(),
            (Some(a), None) if a.len == self.head.len => {
                format!("ends at the recorded head {}", a.hash)
            }
            (Some(a), None) => format!(
                "reaches the recorded head {} (seq {}); seq {}..{} were appended since (the run is not finished)",
                a.hash,
                a.len - 1,
                a.len,
                self.head.len.saturating_sub(1)
            ),
        }
    }
}

/// A received record, checked.
#[derive(Debug)]
pub struct Taken {
    /// What it decodes to, to show (marked when `wrong` is not empty);
    /// `None` when its stored bytes are no record at all.
    pub record: Option<Record>,
    /// What is wrong with it.
    pub wrong: Vec<String>,
}

/// What a record that failed shows: what its stored bytes decode to, when
/// they decode at all (an altered record is shown as what it now says).
fn shown(s: &StoredRecord) -> Option<Record> {
    match s.decode() {
        Ok(r) => Some(r),
        Err(UnreadableRecord::NotCanonical(r)) => Some(*r),
        Err(_) => None,
    }
}

/// The reason of a chain error, without the run and seq it names (the
/// line it marks says those).
fn chain_reason(e: &crate::store::StoreError) -> String {
    match e {
        crate::store::StoreError::ChainBroken { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}

/// The verdict on a log.
#[derive(Debug)]
pub struct Verdict {
    /// The head of what was received.
    pub head: Head,
    /// Records that failed, with why.
    pub marked: BTreeMap<u64, Vec<String>>,
    /// What failed of the log as a whole.
    pub global: Vec<String>,
    /// Every controller record's signature check, in order.
    pub signed: Vec<SignedRecord>,
    /// How the log stands to the recorded head (for a verified log).
    pub anchored: String,
    /// What the reader should know of how it was checked.
    pub notes: Vec<String>,
}

impl Verdict {
    pub fn ok(&self) -> bool {
        self.marked.is_empty() && self.global.is_empty()
    }

    /// Whether the record at `seq` failed.
    pub fn marks(&self, seq: u64) -> bool {
        self.marked.contains_key(&seq)
    }

    /// Every problem, one line each (`seq N: ...` for a record's).
    pub fn problems(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .marked
            .iter()
            .flat_map(|(seq, p)| p.iter().map(move |p| format!("seq {seq}: {p}")))
            .collect();
        out.extend(self.global.iter().cloned());
        out
    }

    /// The controller records whose signature was refused (`seq N (Kind)`).
    pub fn refused(&self) -> Vec<String> {
        self.signed
            .iter()
            .filter(|s| !s.check.accepted())
            .map(|s| format!("seq {} ({})", s.seq, s.kind))
            .collect()
    }
}

/// Checks a whole log read at once, as stored: record by record with
/// [`Checker`], and again with the store's own whole-log audit (the chain
/// from seq 0 to the recorded head, every signature), so the two can only
/// agree on "verified". Returns the records to show (what each decodes to)
/// and the verdict.
pub fn judge(
    uid: &str,
    stored: &[StoredRecord],
    keys: Result<RecordVerifier, Refusal>,
    trust: &Trust,
) -> Result<(Vec<Record>, Verdict), Refusal> {
    let mut checker = Checker::new(uid, keys.clone(), trust);
    let mut records = Vec::with_capacity(stored.len());
    for s in stored {
        records.extend(checker.take(s)?.record);
    }
    if let Ok(keys) = &keys
        && checker.verdict().ok()
    {
        let exact = trust.anchor.filter(|_| trust.terminal).map(|a| a.hash);
        let audit = Audit::of(uid, &records, exact.as_ref(), keys, &trust.rules);
        if let Err(e) = &audit.chain {
            checker.fail(format!("the chain does not verify: {e}"));
        } else if audit.refused().next().is_some() {
            checker.fail("controller signatures were refused".into());
        }
    }
    Ok((records, checker.verdict()))
}

/// What the server said of its own check, when it is worth telling: a
/// failure (its message names what it found, e.g. a record it could not
/// send), or a success this check does not share (the log changed on its
/// way here, or the server is wrong).
pub fn server_said(v: Option<&Verification>, verdict: &Verdict) -> Option<String> {
    let v = v?;
    let message = if v.message.is_empty() {
        String::new()
    } else {
        format!(": {}", v.message)
    };
    match (v.result == VERIFIED, verdict.ok()) {
        (false, _) => Some(format!("the log API's own check: {}{message}", v.result)),
        (true, false) => Some(
            "the log API's own check passed: the log changed between the server and here, or the server is wrong"
                .into(),
        ),
        (true, true) => None,
    }
}
