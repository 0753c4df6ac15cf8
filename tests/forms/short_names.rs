// Models and index values named like the derives' own generic parameters (`E`, `R`, `T`):
// the generated code names its parameters apart, so these compile and query.
use serde::{Deserialize, Serialize};

/// A model named `R` whose index field is a newtype named `E`.
pub mod r {
    use super::*;
    use tito::{IndexValue, TitoModel};

    /// A newtype named `E`.
    #[derive(IndexValue, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
    pub struct E(pub String);

    /// A model named `R`.
    #[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
    #[tito(index = "r_by_team: team, rank")]
    pub struct R {
        /// The id.
        pub id: String,
        /// Its team.
        pub team: E,
        /// Its rank.
        pub rank: i64,
    }
}

/// A model named `E`.
pub mod e {
    use super::*;
    use tito::TitoModel;

    /// A model named `E`.
    #[derive(TitoModel, Default, Clone, Debug, Serialize, Deserialize)]
    #[tito(index = "e_by_name: name")]
    #[tito(unique_index = "e_by_code: code")]
    pub struct E {
        /// The id.
        pub id: String,
        /// Its name.
        pub name: String,
        /// Its code.
        pub code: String,
    }
}

#[cfg(test)]
mod tests {
    use super::e::{E as EModel, EQueries};
    use super::r::{E, R, RQueries};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn models_named_like_generic_parameters_query() {
        use tito::TitoEngine;
        let db = tito::Embedded::temporary().await.unwrap();
        let rs = db.clone().model::<R>();
        rs.build(R {
            id: "1".into(),
            team: E("core".into()),
            rank: 3,
        })
        .await
        .unwrap();
        let found = rs
            .r_by_team(E("core".into()))
            .rank(1..5)
            .execute()
            .await
            .unwrap();
        assert_eq!(found.items.len(), 1);
        let es = db.clone().model::<EModel>();
        es.build(EModel {
            id: "1".into(),
            name: "n".into(),
            code: "c".into(),
        })
        .await
        .unwrap();
        assert_eq!(
            es.e_by_name_range(..).execute().await.unwrap().items.len(),
            1
        );
        assert!(es.get_e_by_code("c").await.unwrap().is_some());
        db.close().await.unwrap();
    }
}
