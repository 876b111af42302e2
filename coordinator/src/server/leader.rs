//! High availability: which of several coordinators sharing one database leads.
//!
//! The lock is behind `LeaderLock`: a PostgreSQL session advisory lock held on a connection of
//! its own (the database drops it the moment the leader's process or connection dies), or an
//! exclusive file lock beside a SQLite database (one machine; a second coordinator on the same
//! file waits as a standby). The `leader` row only *publishes* who leads, so standbys can send
//! the CLI and agents there; `term` grows on every change of leader.
//!
//! Only the leader serves the control API, takes agents and runs the background work
//! (leases, launch timeouts, resuming jobs). A leader that can no longer prove it holds the
//! lock within a base interval stops at its next check (`run` returns an error; the binary
//! exits and systemd restarts it as a standby); until then every job move it makes is fenced
//! by its term inside the move's transaction (`Store::fence`), so a deposed leader's late
//! writes are refused rather than applied.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;
use std::time::Duration;

use serde::Serialize;
use sqlx::{Connection, Row};

use crate::error::{CoordinatorError, Result};
use crate::store::Store;

/// The advisory-lock key every Motley coordinator of one database contends for ("motley").
const PG_LOCK_KEY: i64 = 0x6d6f_746c_6579;

/// A lock at most one coordinator holds.
#[tonic::async_trait]
pub trait LeaderLock: Send {
    /// Take the lock if it is free; true once this coordinator holds it.
    async fn try_acquire(&mut self) -> Result<bool>;
    /// Whether the lock is still held (false or an error: step down).
    async fn still_held(&mut self) -> Result<bool>;
}

/// An exclusive `flock` on a file (SQLite: coordinators on one machine sharing one file).
pub struct FileLock {
    path: PathBuf,
    held: Option<std::fs::File>,
}

impl FileLock {
    pub fn new(path: PathBuf) -> FileLock {
        FileLock { path, held: None }
    }
}

#[tonic::async_trait]
impl LeaderLock for FileLock {
    async fn try_acquire(&mut self) -> Result<bool> {
        if self.held.is_some() {
            return Ok(true);
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&self.path)
            .map_err(|e| CoordinatorError::invalid("--data-dir", format!("cannot open {}: {e}", self.path.display())))?;
        match file.try_lock() {
            Ok(()) => {
                self.held = Some(file);
                Ok(true)
            }
            Err(std::fs::TryLockError::WouldBlock) => Ok(false),
            Err(std::fs::TryLockError::Error(e)) => {
                Err(CoordinatorError::invalid("--data-dir", format!("cannot lock {}: {e}", self.path.display())))
            }
        }
    }

    async fn still_held(&mut self) -> Result<bool> {
        // A file lock lasts as long as the open file; nothing can take it from us.
        Ok(self.held.is_some())
    }
}

/// A leader that has not renewed for this many base intervals is taken over (PostgreSQL).
pub const STALE_LEADER_INTERVALS: u32 = 5;

/// A PostgreSQL session advisory lock on a dedicated connection. The holder also renews
/// `leader_renewal.renewed_at_ms` (the database's clock) every base interval; a standby that finds it
/// older than `STALE_LEADER_INTERVALS` intervals ends the holder's session (a frozen leader's
/// session lives on, and with it the lock) and takes the lock.
pub struct PgAdvisoryLock {
    url: String,
    conn: Option<sqlx::AnyConnection>,
    held: bool,
    base: Duration,
}

impl PgAdvisoryLock {
    pub fn new(url: &str, base: Duration) -> PgAdvisoryLock {
        PgAdvisoryLock { url: url.to_string(), conn: None, held: false, base }
    }
}

/// The database's clock, in ms since the epoch (one clock for every coordinator).
const DB_NOW_MS: &str = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)";

async fn renew(conn: &mut sqlx::AnyConnection) -> Result<()> {
    // A row of its own: job moves lock the `leader` row (the term fence), and a renewal must
    // never wait behind them.
    sqlx::query(sqlx::AssertSqlSafe(format!("UPDATE leader_renewal SET renewed_at_ms = {DB_NOW_MS} WHERE id = 1")))
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// If the lock's holder stopped renewing, end its session (which frees the lock); true if so.
async fn end_stale_holder(conn: &mut sqlx::AnyConnection, stale: Duration) -> Result<bool> {
    let row =
        sqlx::query(sqlx::AssertSqlSafe(format!("SELECT renewed_at_ms, {DB_NOW_MS} - renewed_at_ms FROM leader_renewal WHERE id = 1")))
            .fetch_one(&mut *conn)
            .await?;
    let (renewed, age): (i64, i64) = (row.try_get(0)?, row.try_get(1)?);
    if renewed == 0 || age <= stale.as_millis() as i64 {
        return Ok(false);
    }
    // A bigint advisory key is (classid, objid) = (high, low) 32 bits, objsubid 1; advisory
    // locks are per database, and pg_locks shows the whole server's.
    let holder = sqlx::query(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 \
         AND CAST(classid AS BIGINT) = $1 AND CAST(objid AS BIGINT) = $2 \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .bind(PG_LOCK_KEY >> 32)
    .bind(PG_LOCK_KEY & 0xffff_ffff)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(holder) = holder else { return Ok(false) };
    let pid: i32 = holder.try_get(0)?;
    tracing::warn!(pid, age_ms = age, "the leader has not renewed for {age} ms; ending its database session to take over");
    sqlx::query("SELECT pg_terminate_backend($1)").bind(pid).execute(&mut *conn).await?;
    Ok(true)
}

#[tonic::async_trait]
impl LeaderLock for PgAdvisoryLock {
    async fn try_acquire(&mut self) -> Result<bool> {
        if self.held {
            return Ok(true);
        }
        if self.conn.is_none() {
            let mut conn = sqlx::AnyConnection::connect(&self.url).await?;
            // The lock lives as long as this session; if the leader's machine dies without
            // closing it, keepalives end the session (and free the lock) in seconds, not hours.
            for set in ["SET tcp_keepalives_idle = 1", "SET tcp_keepalives_interval = 1", "SET tcp_keepalives_count = 3"] {
                sqlx::query(set).execute(&mut conn).await?;
            }
            self.conn = Some(conn);
        }
        let conn = self.conn.as_mut().expect("connected above");
        let stale = self.base * STALE_LEADER_INTERVALS;
        let attempt = async {
            let take = || sqlx::query("SELECT pg_try_advisory_lock($1)").bind(PG_LOCK_KEY);
            let mut held = take().fetch_one(&mut *conn).await?.try_get::<bool, _>(0)?;
            if !held && end_stale_holder(conn, stale).await? {
                // The terminated session's locks go with it (at once, or within moments).
                for _ in 0..10 {
                    held = take().fetch_one(&mut *conn).await?.try_get::<bool, _>(0)?;
                    if held {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            if held {
                // Renewed before the claim: a standby must not find the new leader stale.
                renew(conn).await?;
            }
            Ok::<bool, CoordinatorError>(held)
        };
        match attempt.await {
            Ok(held) => {
                self.held = held;
                Ok(held)
            }
            Err(e) => {
                // A broken connection is opened again next time.
                self.conn = None;
                Err(e)
            }
        }
    }

    async fn still_held(&mut self) -> Result<bool> {
        let Some(conn) = self.conn.as_mut() else { return Ok(false) };
        // The lock lives exactly as long as this session: if the session answers, we hold it.
        // The answer is the renewal standbys judge this leader's life by.
        renew(conn).await?;
        Ok(self.held)
    }
}

/// The lock that fits the database URL: beside the SQLite file itself (coordinators with
/// different data directories may share one database file).
pub fn lock_for(database_url: &str, base: Duration) -> Box<dyn LeaderLock> {
    if database_url.starts_with("postgres://") || database_url.starts_with("postgresql://") {
        return Box::new(PgAdvisoryLock::new(database_url, base));
    }
    let path = database_url.strip_prefix("sqlite://").unwrap_or(database_url);
    let path = path.split('?').next().unwrap_or(path);
    Box::new(FileLock::new(PathBuf::from(format!("{path}.leader-lock"))))
}

/// Where a coordinator serves (what the leader publishes).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LeaderInfo {
    pub term: i64,
    pub rest_url: String,
    pub grpc_url: String,
}

/// This coordinator's role, shared by the API edges.
#[derive(Default)]
pub struct Role {
    leading: AtomicBool,
    known: RwLock<LeaderInfo>,
}

impl Role {
    /// A role that leads from the start (tests of a single coordinator).
    pub fn leading() -> std::sync::Arc<Role> {
        let r = Role::default();
        r.leading.store(true, Ordering::SeqCst);
        std::sync::Arc::new(r)
    }

    pub fn is_leader(&self) -> bool {
        self.leading.load(Ordering::SeqCst)
    }

    /// The leader as last read from the database.
    pub fn leader(&self) -> LeaderInfo {
        self.known.read().expect("leader lock").clone()
    }

    /// The refusal a standby answers with, naming where the leader is.
    pub fn not_leader(&self) -> CoordinatorError {
        let l = self.leader();
        CoordinatorError::NotLeader { rest_url: l.rest_url, grpc_url: l.grpc_url }
    }
}

impl Store {
    /// Publish this coordinator as the leader; returns the new term.
    pub async fn claim_leadership(&self, rest_url: &str, grpc_url: &str) -> Result<i64> {
        let row = sqlx::query("UPDATE leader SET term = term + 1, rest_url = $1, grpc_url = $2, since_ms = $3 WHERE id = 1 RETURNING term")
            .bind(rest_url)
            .bind(grpc_url)
            .bind(crate::store::now_ms())
            .fetch_one(&self.pool)
            .await?;
        Ok(row.try_get::<i64, _>(0)?)
    }

    /// Who leads, as published.
    pub async fn leader_info(&self) -> Result<LeaderInfo> {
        let row = sqlx::query("SELECT term, rest_url, grpc_url FROM leader WHERE id = 1").fetch_one(&self.pool).await?;
        Ok(LeaderInfo { term: row.try_get("term")?, rest_url: row.try_get("rest_url")?, grpc_url: row.try_get("grpc_url")? })
    }
}

/// One coordinator contending for leadership.
pub struct Contender<F: FnOnce(i64) + Send> {
    pub store: Store,
    pub lock: Box<dyn LeaderLock>,
    pub role: std::sync::Arc<Role>,
    /// What this coordinator publishes when it leads.
    pub me: LeaderInfo,
    /// Called once, when leadership is won (start the leader's background work).
    pub on_lead: Option<F>,
    /// The base interval: the period of `run` and the limit on every lock call.
    pub base: Duration,
}

impl<F: FnOnce(i64) + Send> Contender<F> {
    /// One round: a leader checks it still holds the lock (an error: leadership is lost); a
    /// standby tries to take it, and otherwise reads who leads.
    pub async fn step(&mut self) -> Result<()> {
        if self.role.is_leader() {
            // An answer that takes longer than a base interval counts as lost: a leader cut off
            // from the database must stop before a standby (which may get the lock once the
            // session dies) starts.
            return match tokio::time::timeout(self.base, self.lock.still_held()).await {
                Ok(Ok(true)) => Ok(()),
                Ok(Ok(false)) => Err(CoordinatorError::Conflict("leadership lost: the lock is gone".into())),
                Ok(Err(e)) => Err(CoordinatorError::Conflict(format!("leadership lost: {e}"))),
                Err(_) => Err(CoordinatorError::Conflict("leadership lost: the lock did not answer within a base interval".into())),
            };
        }
        let attempt = match tokio::time::timeout(self.base, self.lock.try_acquire()).await {
            Ok(r) => r,
            Err(_) => Err(CoordinatorError::Unavailable("the leader lock did not answer within a base interval".into())),
        };
        match attempt {
            Ok(true) => {
                // Bounded: the old leader's row lock (a move it froze in) holds the claim until
                // the database ends that session; past the bound, this process exits and
                // contends again.
                let claim = self.store.claim_leadership(&self.me.rest_url, &self.me.grpc_url);
                let term = tokio::time::timeout(self.base * STALE_LEADER_INTERVALS * 4, claim)
                    .await
                    .map_err(|_| CoordinatorError::Unavailable("claiming leadership: the leader row stayed locked".into()))??;
                self.store.fence(term);
                *self.role.known.write().expect("leader lock") = LeaderInfo { term, ..self.me.clone() };
                self.role.leading.store(true, Ordering::SeqCst);
                tracing::info!(term, "leading");
                if let Some(f) = self.on_lead.take() {
                    f(term);
                }
            }
            Ok(false) => {
                if let Ok(info) = self.store.leader_info().await {
                    *self.role.known.write().expect("leader lock") = info;
                }
            }
            Err(e) => tracing::warn!("cannot reach the leader lock: {e}"),
        }
        Ok(())
    }

    /// `step` every base interval; returns only when leadership is lost.
    pub async fn run(mut self) -> Result<()> {
        let mut tick = tokio::time::interval(self.base);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.step().await?;
        }
    }
}
