//! The cluster's identity (migration 0011; `crate::job::cluster`): named once, by whichever
//! coordinator first finds the name empty, and read by every coordinator at open, so HA
//! coordinators and restarts share it, and a second database (another cluster) has its own.

use sqlx::{AnyPool, Row};

use super::Store;
use crate::error::{CoordinatorError, Result};
use crate::job::cluster::{new_id, valid_id, ClusterIdentity, ID_BYTES};

/// The stored identity, named now from fresh random bytes if it has no name yet. Two
/// coordinators opening at once both get the name that landed first.
pub(super) async fn load(pool: &AnyPool) -> Result<ClusterIdentity> {
    let mut random = [0u8; ID_BYTES];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random))
        .map_err(|e| CoordinatorError::Unavailable(format!("reading /dev/urandom for the cluster's id: {e}")))?;
    sqlx::query("UPDATE cluster SET cluster_id = $1 WHERE id = 1 AND cluster_id = ''").bind(new_id(&random)).execute(pool).await?;
    let row = sqlx::query("SELECT cluster_id, first_job FROM cluster WHERE id = 1").fetch_one(pool).await?;
    let identity = ClusterIdentity { id: row.try_get("cluster_id")?, first_job: row.try_get("first_job")? };
    if !valid_id(&identity.id) {
        return Err(CoordinatorError::Conflict(format!(
            "the stored cluster id '{}' (table cluster) is not 1 to 64 lowercase letters, digits and '-'; it names this \
             cluster's jobs in the checkpoint cloud: set it back to the name their directories have there (URL/NAME/jobs/...)",
            identity.id.escape_debug()
        )));
    }
    Ok(identity)
}

impl Store {
    /// This cluster's identity, as read when the store was opened.
    pub fn cluster(&self) -> &ClusterIdentity {
        &self.cluster
    }
}
