// Index values of the application's own types: a unit enum by serde name, newtypes over a
// string and an integer (one transparent), and `Option` and `Vec` of them, with the generated
// queries taking them by value and by reference.
use serde::{Deserialize, Serialize};
use tito::{IndexValue, TitoModel};

/// A status, indexed by its serde name.
#[derive(IndexValue, Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Not started.
    #[default]
    Todo,
    /// Under way.
    Doing,
    /// Finished.
    Done,
}

/// A board's id.
#[derive(IndexValue, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BoardId(pub String);

/// Points, a transparent one-field struct over an integer.
#[derive(IndexValue, Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Points {
    /// The number.
    pub value: u32,
}

/// A card of a board.
#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(index = "card_by_board_stage: board, stage")]
#[tito(index = "card_by_points: points")]
#[tito(index = "card_by_blocked: blocked_on")]
#[tito(index = "card_by_past: past")]
pub struct Card {
    /// The id.
    pub id: String,
    /// Its board.
    pub board: BoardId,
    /// Where it is.
    pub stage: Stage,
    /// Its size.
    pub points: Points,
    /// The stage it waits for, if any (sparse).
    pub blocked_on: Option<Stage>,
    /// Every stage it was in (an entry each).
    pub past: Vec<Stage>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use tito::TitoEngine;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cards_are_found_by_their_own_types() {
        let db = tito::Embedded::temporary().await.unwrap();
        let cards = db.clone().model::<Card>();
        let board = BoardId("b1".into());
        cards
            .build(Card {
                id: "1".into(),
                board: board.clone(),
                stage: Stage::Doing,
                points: Points { value: 3 },
                blocked_on: Some(Stage::Done),
                past: vec![Stage::Todo, Stage::Doing],
            })
            .await
            .unwrap();
        let doing = cards
            .card_by_board_stage(&board)
            .stage_eq(Stage::Doing)
            .execute()
            .await
            .unwrap();
        assert_eq!(doing.items.len(), 1);
        let small = cards
            .card_by_points_range(..Points { value: 5 })
            .execute()
            .await
            .unwrap();
        assert_eq!(small.items.len(), 1);
        assert_eq!(
            cards
                .card_by_blocked(Stage::Done)
                .execute()
                .await
                .unwrap()
                .items
                .len(),
            1
        );
        assert_eq!(
            cards
                .card_by_past(Stage::Todo)
                .execute()
                .await
                .unwrap()
                .items
                .len(),
            1
        );
        db.close().await.unwrap();
    }
}
