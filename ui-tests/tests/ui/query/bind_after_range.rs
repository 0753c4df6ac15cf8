// Nothing can be bound after a range: `rank` comes after the range over `team`.
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
    let _ = players.by_team_rank_range("a".."m").rank_eq(&3).execute().await;
}

fn main() {}
