//! This cluster's identity, and where its jobs' checkpoints go in a checkpoint cloud
//! (docs/recovery.md, "Where checkpoint bytes live"). Pure: the store makes and keeps the
//! identity (migration 0011, `Store::cluster`); launches and restores ask here for the URL.
//!
//! Every cluster numbers its jobs from 1, and a checkpoint cloud is shared storage (one bucket,
//! one NFS directory for several clusters, or for a second `motley dev up`): the prefix a job's
//! agents upload to and restore from is the job file's `checkpoint.cloud` with the cluster's id
//! as one more path segment, `URL/CLUSTER/jobs/JOB/GEN/step-S/FILE`. The agents build the rest
//! of the key from what they are given (`MOTLEY_CKPT_CLOUD`, a restore's `cloud_url`).

use crate::job::spec::JobSpec;

/// Random bytes in a new cluster id (written as twice as many hex digits).
pub const ID_BYTES: usize = 8;

/// Who this cluster is, as its database keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterIdentity {
    /// Random, made once (`ID_BYTES` as lowercase hex); HA coordinators share it.
    pub id: String,
    /// The first job whose cloud prefix carries `id`. Jobs numbered before (by a coordinator of
    /// a version without an identity) keep `URL/jobs/JOB/...`, where their steps already are.
    pub first_job: i64,
}

impl ClusterIdentity {
    /// The cloud prefix job `job` uploads to and restores from (`MOTLEY_CKPT_CLOUD`, a
    /// restore's `cloud_url`): `url` with the cluster id appended as a path segment (before a
    /// query or fragment), or `url` unchanged for a job numbered before the identity existed.
    pub fn job_cloud(&self, url: &str, job: i64) -> String {
        if job < self.first_job {
            return url.to_string();
        }
        let cut = url.find(['?', '#']).unwrap_or(url.len());
        let (base, rest) = url.split_at(cut);
        let sep = if base.ends_with('/') { "" } else { "/" };
        format!("{base}{sep}{}{rest}", self.id)
    }

    /// The cloud prefix of job `job` of `spec`, if the job file names a cloud.
    pub fn checkpoint_cloud(&self, spec: &JobSpec, job: i64) -> Option<String> {
        spec.checkpoint.as_ref()?.cloud.as_deref().map(|url| self.job_cloud(url, job))
    }

    /// Where job `job`'s checkpoint steps are in its cloud, as people look for them:
    /// `PREFIX/jobs/JOB` (a directory per generation under it, `GEN/step-S/`).
    pub fn job_checkpoints(&self, spec: &JobSpec, job: i64) -> Option<String> {
        let prefix = self.checkpoint_cloud(spec, job)?;
        let cut = prefix.find(['?', '#']).unwrap_or(prefix.len());
        let (base, rest) = prefix.split_at(cut);
        let sep = if base.ends_with('/') { "" } else { "/" };
        Some(format!("{base}{sep}jobs/{job}{rest}"))
    }

    /// `job_checkpoints` of job `job` whose spec is `spec_json` (as the store keeps it).
    pub fn stored_checkpoints(&self, spec_json: &str, job: i64) -> Option<String> {
        let spec: JobSpec = serde_json::from_str(spec_json).ok()?;
        self.job_checkpoints(&spec, job)
    }
}

/// A stored cluster id this version uses in paths: 1 to 64 lowercase letters, digits and `-`
/// (a made one is hex), so that it is one path segment on every object store.
pub fn valid_id(id: &str) -> bool {
    (1..=64).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// A new id from `random` bytes: lowercase hex.
pub fn new_id(random: &[u8; ID_BYTES]) -> String {
    random.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster() -> ClusterIdentity {
        ClusterIdentity { id: "0a1b2c3d4e5f6789".into(), first_job: 4 }
    }

    #[test]
    fn a_jobs_cloud_prefix_carries_the_cluster_id_as_one_segment() {
        let c = cluster();
        assert_eq!(c.job_cloud("file:///srv/ckpt", 4), "file:///srv/ckpt/0a1b2c3d4e5f6789");
        assert_eq!(c.job_cloud("file:///srv/ckpt/", 9), "file:///srv/ckpt/0a1b2c3d4e5f6789");
        assert_eq!(c.job_cloud("file:///", 9), "file:///0a1b2c3d4e5f6789");
        assert_eq!(c.job_cloud("s3://bucket", 9), "s3://bucket/0a1b2c3d4e5f6789");
        assert_eq!(c.job_cloud("gs://bucket/runs?x=1", 9), "gs://bucket/runs/0a1b2c3d4e5f6789?x=1");
    }

    #[test]
    fn a_job_numbered_before_the_identity_keeps_its_old_prefix() {
        let c = cluster();
        assert_eq!(c.job_cloud("file:///srv/ckpt", 3), "file:///srv/ckpt", "its steps are already there");
        assert_eq!(c.job_cloud("file:///srv/ckpt", 1), "file:///srv/ckpt");
    }

    #[test]
    fn a_jobs_checkpoints_are_under_jobs_and_its_id() {
        let mut spec = JobSpec::parse("name: j\nmodel: gpt3-1.3b\nglobal_batch: 8\nrun: 'true'\n").unwrap();
        assert_eq!(cluster().checkpoint_cloud(&spec, 5), None, "no cloud named");
        spec.checkpoint = Some(crate::job::spec::CheckpointSpec { every: 1, keep: None, cloud: Some("file:///c".into()) });
        assert_eq!(cluster().checkpoint_cloud(&spec, 5).as_deref(), Some("file:///c/0a1b2c3d4e5f6789"));
        assert_eq!(cluster().job_checkpoints(&spec, 5).as_deref(), Some("file:///c/0a1b2c3d4e5f6789/jobs/5"));
        assert_eq!(cluster().job_checkpoints(&spec, 2).as_deref(), Some("file:///c/jobs/2"));
    }

    #[test]
    fn ids_are_one_plain_path_segment() {
        assert_eq!(new_id(&[0, 1, 0xab, 0xff, 16, 32, 64, 128]), "0001abff10204080");
        assert!(valid_id(&new_id(&[7; ID_BYTES])));
        for bad in ["", "a/b", "..", "A1", "a b", "%2e", &"a".repeat(65)] {
            assert!(!valid_id(bad), "{bad:?}");
        }
    }
}
