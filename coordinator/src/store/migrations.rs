//! The schema's migrations (`migrations/`), embedded in the binary and applied at open.
//!
//! They are listed here, each file's text included at compile time, rather than embedded by
//! `sqlx::migrate!`: that proc-macro needs sqlx's `macros` feature, which builds the whole of
//! sqlx and both of its drivers (SQLite's C source included) a second time for the compiler,
//! a large part of a cold build on a small machine. The migrator is the one the macro would
//! make: the same versions, descriptions and checksums (SHA-384 of the file's text, which a
//! database migrated by an earlier build has recorded and checks at every open).
//!
//! A new migration is a new file and a new line below; the tests fail until both agree, and
//! until a file that has landed still reads as it did (migrations are never edited).

use std::borrow::Cow;
use std::sync::LazyLock;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::SqlStr;

/// (version, file name's description part, text) in version order.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "state", include_str!("../../../migrations/0001_state.sql")),
    (2, "leader", include_str!("../../../migrations/0002_leader.sql")),
    (3, "ranks_by_state", include_str!("../../../migrations/0003_ranks_by_state.sql")),
    (4, "leader_renewal", include_str!("../../../migrations/0004_leader_renewal.sql")),
    (5, "layer_profiles", include_str!("../../../migrations/0005_layer_profiles.sql")),
    (6, "ckpt_locations", include_str!("../../../migrations/0006_ckpt_locations.sql")),
    (7, "recovery", include_str!("../../../migrations/0007_recovery.sql")),
    (8, "profile_runs", include_str!("../../../migrations/0008_profile_runs.sql")),
    (9, "ckpt_locations_by_generation", include_str!("../../../migrations/0009_ckpt_locations_by_generation.sql")),
    (10, "data_plane_key", include_str!("../../../migrations/0010_data_plane_key.sql")),
    (11, "cluster_identity", include_str!("../../../migrations/0011_cluster_identity.sql")),
];

static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    Migrator::with_migrations(
        MIGRATIONS
            .iter()
            .map(|&(version, name, sql)| {
                // As sqlx names a migration from its file: underscores read as spaces; a file
                // that opens with `-- no-transaction` runs outside a transaction.
                let description = Cow::Owned(name.replace('_', " "));
                let no_tx = sql.starts_with("-- no-transaction");
                Migration::new(version, description, MigrationType::Simple, SqlStr::from_static(sql), no_tx)
            })
            .collect(),
    )
});

/// The schema's migrator: `run` brings a database to the newest version (what `Store::open`
/// does), `run_to` to an earlier one (tests of upgrades).
pub fn migrator() -> &'static Migrator {
    &MIGRATOR
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha384};
    use std::path::Path;

    fn dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations")
    }

    #[test]
    fn every_file_in_the_directory_is_embedded_in_order() {
        let mut files: Vec<String> = std::fs::read_dir(dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".sql"))
            .collect();
        files.sort();
        let listed: Vec<String> = MIGRATIONS.iter().map(|(v, name, _)| format!("{v:04}_{name}.sql")).collect();
        assert_eq!(files, listed, "migrations/ and store/migrations.rs list the same files");
        for (file, (_, _, sql)) in files.iter().zip(MIGRATIONS) {
            assert_eq!(std::fs::read_to_string(dir().join(file)).unwrap(), *sql, "{file} is the text embedded");
        }
        let versions: Vec<i64> = migrator().iter().map(|m| m.version).collect();
        assert_eq!(versions, (1..=MIGRATIONS.len() as i64).collect::<Vec<_>>());
    }

    #[test]
    fn checksums_are_those_earlier_builds_recorded() {
        // SHA-384 of each file as landed: what `_sqlx_migrations.checksum` holds in every database
        // an earlier build (sqlx::migrate!) migrated. A file edited, or a migrator that hashes
        // otherwise, fails here before it fails a deployed coordinator's open.
        let landed = [
            "b55ffb4dec66aec7b6406eff7f40fc1f0bbeb87693b792301388c972e18f8ee369d98c0269cd0c77fa5f8f060ab59ac9",
            "244eaff019c0dc923e748cae41db149a7cfc50e3e61be76e13ba7cba2ce3bf98936bf53dfd39b61fa3b7a95e9d4bca57",
            "0c8350109f1fc1e46ead9d8ae021308b41c1e35360695501b5439b3d50d0ca212918e95e740b1ccb872c3579179e4ea9",
            "b4f8e86ae8224cead6236db1c46d1ecd21b931928ed8995f3856918cf7c749194e73419709f81e36b95e4e7e91257644",
            "9f463725274458c57ba1f7924d138f00c1c1a847613bf1d1d35c5961d0aa7164616deb18f41ca228e2c7eb26adfd4a96",
            "2fffdac0436368cfac4cbc3f9547d168c6eb6b76bc824cefd383ef657e9142b15df3838a1b225d35cb31864d8b228ec4",
            "6455a78b4d3315bde8136d27d94275b168e8433c4d5ed8495935c4cfd501c43385c85a39f17395f1154f45fe572fcc2d",
            "2e850e0faddf31f323cdeed2d49afedda6444fd562ce38cddf31e716c67e486d3835bbfb42634f25b92c617d5ad13d83",
            "2a54f3abdcf488bfb41ca9bfd4fb1e3ff5bc1f148b9082d111d57598afcfe8f8635cc9d08bdd759b574edd3697f9ea99",
            "cfe6b31f842f369fc67ee194bbb8ea6a50212c1a209c372208efd9ebdbfb50a444266fe7d3637644447199dc677ebc7b",
            "fffc8fefcb535c324d57b957d88cacb27c3eb6dc177af104d097e1f147524a87c13f9febc0cf3bbd361966d51cbd1132",
        ];
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let checksums: Vec<String> = migrator().iter().map(|m| hex(&m.checksum)).collect();
        assert_eq!(checksums[..landed.len()], landed, "a landed migration's checksum changed");
        // A migration added later: its checksum is its file's hash too.
        for (m, (_, _, sql)) in migrator().iter().zip(MIGRATIONS) {
            assert_eq!(hex(&m.checksum), hex(&Sha384::digest(sql.as_bytes())));
        }
        let descriptions: Vec<&str> = migrator().iter().map(|m| m.description.as_ref()).collect();
        assert_eq!(descriptions[8], "ckpt locations by generation", "sqlx's description of 0009");
    }
}
