//! The data-plane key (migration 0010; docs/recovery.md, "Who may fetch"): generated once, by
//! whichever coordinator first finds none, and shared from then on through the database, so a
//! standby that takes over signs and accepts the same capabilities as the leader before it.

use sqlx::Row;

use super::Store;
use crate::error::{CoordinatorError, Result};

const DATA_PLANE_KEY: &str = "data_plane_key";

impl Store {
    /// The cluster's data-plane key: the stored one, or `candidate` (fresh random bytes) stored
    /// now if there is none. Two coordinators racing both get the one that landed first.
    pub async fn data_plane_key(&self, candidate: &[u8]) -> Result<Vec<u8>> {
        let hex: String = candidate.iter().map(|b| format!("{b:02x}")).collect();
        sqlx::query("INSERT INTO secrets (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING")
            .bind(DATA_PLANE_KEY)
            .bind(hex)
            .execute(&self.pool)
            .await?;
        let row = sqlx::query("SELECT value FROM secrets WHERE name = $1").bind(DATA_PLANE_KEY).fetch_one(&self.pool).await?;
        let stored: String = row.try_get("value")?;
        let bytes = (0..stored.len())
            .step_by(2)
            .map(|i| stored.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
            .collect::<Option<Vec<u8>>>()
            .filter(|b| b.len() == motley_server::capability::KEY_BYTES);
        bytes.ok_or_else(|| {
            CoordinatorError::Conflict(format!(
                "the stored data-plane key (table secrets, row {DATA_PLANE_KEY}) is not {} hex digits; delete the row and restart \
                 the coordinators to generate a new one",
                2 * motley_server::capability::KEY_BYTES
            ))
        })
    }
}
