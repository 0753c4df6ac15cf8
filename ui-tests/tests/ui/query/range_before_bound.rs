// A range over `rank` needs `team` bound first.
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
    let _ = players.rank(1..5).execute().await;
}

fn main() {}
