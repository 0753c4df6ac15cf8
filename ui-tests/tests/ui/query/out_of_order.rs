// Fields bind in index order: after `team`, the next field is `rank`, not `team` again.
use serde::{Deserialize, Serialize};
use tito::backend::embedded::Embedded;
use tito::{TitoEngine, TitoModel};

#[derive(TitoModel, Default, Clone, Serialize, Deserialize)]
#[tito(index = "by_team_rank: team, rank")]
struct Player {
    id: String,
    team: String,
    rank: i64,
}

async fn query(db: Embedded) {
    let players = db.model::<Player>();
    let _ = players.by_team_rank("red").team_eq("blue").execute().await;
}

fn main() {}
