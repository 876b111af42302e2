//! Two clusters sharing one checkpoint cloud (docs/recovery.md, "Where checkpoint bytes live"):
//! two coordinators, each with its own database and a real agent, each run their job 1, which
//! saves step 1 and uploads it to the same `file://` directory. Each cluster has its own
//! identity (`GET /api/v1/leader`), each job's steps land under its cluster's prefix
//! (`CLOUD/CLUSTER/jobs/1/1/step-00000001/`, as `GET /api/v1/jobs/1` says), and neither
//! overwrites the other's.

use crate::common;

use std::path::{Path, PathBuf};

use common::{wait_for_state, Agent, Coordinator};
use motley_checkpoint::manifest::{piece_file_name, rank_file_name, unit_file_name};
use motley_checkpoint::{Block, Manifest, Part, RankEntry, UnitEntry, UnitKey, FORMAT};

const UNIT_BYTES: usize = 4096;

/// Step 1 of a one-rank job as `motley_torch` leaves it, with real chunk crcs: one unit whose
/// bytes are `fill`, the rank file, the rank's piece and the merged manifest.
fn prepared_step(dir: &Path, fill: u8) -> PathBuf {
    let step = dir.join("step-00000001");
    std::fs::create_dir_all(&step).unwrap();
    let key = UnitKey { block: Block::Layer(0), part: Part::Model, tp_rank: 0, tp_size: 1 };
    let (unit, rank) = (unit_file_name(&key), rank_file_name(0));
    let data = vec![fill; UNIT_BYTES];
    std::fs::write(step.join(&unit), &data).unwrap();
    std::fs::write(step.join(&rank), b"rank state").unwrap();
    let piece = Manifest {
        format: FORMAT.into(),
        step: 1,
        layers: 1,
        world_size: 1,
        units: vec![UnitEntry { key, file: motley_checkpoint::crc::file_entry(&unit, &data, 1024), tensors: Default::default() }],
        ranks: vec![RankEntry { rank: 0, file: motley_checkpoint::crc::file_entry(&rank, b"rank state", 1024) }],
        lost_ranks: vec![],
    };
    let text = serde_json::to_vec(&piece).unwrap();
    std::fs::write(step.join(piece_file_name(0)), &text).unwrap();
    std::fs::write(step.join("manifest.json"), &text).unwrap();
    step
}

/// A cluster: a coordinator on its own database and one agent.
struct Cluster {
    c: Coordinator,
    _agent: common::Proc,
}

fn cluster(dir: &Path, port_base: u32) -> Cluster {
    let c = Coordinator::start(&dir.join("coordinator"), &["--heartbeat-ms", "300", "--master-port-base", &port_base.to_string()]);
    let agent_token = c.agent_token.clone().unwrap();
    let agent = Agent::new(&c.grpc_url(), "node-0", "examples/nodes/a100.yaml", &dir.join("agent"))
        .arg("--allow-root-ranks")
        .args(["--token", &agent_token])
        .spawn();
    common::until("the agent registered", || (c.json("GET", "/api/v1/nodes", "", 200)[0]["live"] == true).then_some(()));
    Cluster { c, _agent: agent }
}

#[test]
fn two_clusters_sharing_a_cloud_keep_their_job_1s_apart() {
    let dir = common::temp_dir();
    let cloud = dir.join("cloud");
    std::fs::create_dir(&cloud).unwrap();
    let base: u32 = common::master_port_base().parse().unwrap();
    let clusters = [cluster(&dir.join("a"), base), cluster(&dir.join("b"), base + 512)];
    let ids: Vec<String> =
        clusters.iter().map(|k| k.c.json("GET", "/api/v1/leader", "", 200)["cluster_id"].as_str().unwrap().to_string()).collect();
    assert!(ids.iter().all(|id| id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit())), "{ids:?}");
    assert_ne!(ids[0], ids[1], "two databases, two clusters");

    // Each job 1 saves step 1 (its own bytes) and waits until its agent uploaded it.
    for (k, (cl, fill)) in clusters.iter().zip([b'a', b'b']).enumerate() {
        let step = prepared_step(&dir.join(format!("prepared-{k}")), fill);
        let script = dir.join(format!("save-{k}.sh"));
        std::fs::write(
            &script,
            format!(
                // Whole at once (renamed into place), as the tiers expect a step to appear.
                "mkdir -p \"$MOTLEY_CKPT_DIR\" && cp -r {} \"$MOTLEY_CKPT_DIR/.saving\"\n\
                 mv \"$MOTLEY_CKPT_DIR/.saving\" \"$MOTLEY_CKPT_DIR/step-00000001\"\n\
                 up=\"${{MOTLEY_CKPT_CLOUD#file://}}/jobs/$MOTLEY_JOB/1/step-00000001/manifest.json\"\n\
                 until [ -e \"$up\" ]; do sleep 0.05; done\n",
                step.display()
            ),
        )
        .unwrap();
        let job = format!(
            "name: saver\nmodel: gpt3-1.3b\nglobal_batch: 16\nresources: {{gpus: 1}}\n\
             checkpoint: {{every: 1, cloud: 'file://{}'}}\nrun: 'sh {}'\n",
            cloud.display(),
            script.display()
        );
        let submitted = cl.c.json("POST", "/api/v1/jobs", &job, 201);
        assert_eq!(submitted["id"], 1, "every cluster numbers its jobs from 1");
        assert_eq!(submitted["checkpoint_cloud"].as_str().unwrap(), format!("file://{}/{}/jobs/1", cloud.display(), ids[k]));
    }
    for cl in &clusters {
        let done = wait_for_state(&cl.c, 1, &["succeeded", "failed"]);
        assert_eq!(done["state"], "succeeded", "{done}");
    }

    let key = UnitKey { block: Block::Layer(0), part: Part::Model, tp_rank: 0, tp_size: 1 };
    for (id, fill) in ids.iter().zip([b'a', b'b']) {
        let unit = cloud.join(id).join("jobs/1/1/step-00000001").join(unit_file_name(&key));
        assert_eq!(std::fs::read(&unit).unwrap(), vec![fill; UNIT_BYTES], "{}: its own cluster's bytes", unit.display());
    }
    let mut top: Vec<String> = std::fs::read_dir(&cloud).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    top.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(top, want, "nothing outside the clusters' prefixes");
}
