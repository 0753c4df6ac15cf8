// A model with two previous shapes: older rows read through `From` and a fallible `upgrade`.
use serde::{Deserialize, Serialize};
use tito::model::{ShapeError, TitoModelTrait, TitoShape};
use tito::{TitoModel, TitoShape};

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 1)]
struct UserV1 {
    id: String,
    name: String,
}

#[derive(TitoShape, Serialize, Deserialize)]
#[tito(version = 2, from = "UserV1", upgrade = "split")]
struct UserV2 {
    id: String,
    first: String,
    last: String,
}

fn split(v1: UserV1) -> Result<UserV2, String> {
    let (first, last) = v1.name.split_once(' ').ok_or("no space")?;
    Ok(UserV2 {
        id: v1.id,
        first: first.into(),
        last: last.into(),
    })
}

#[derive(TitoModel, Default, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[tito(version = 3, from = "UserV2", downgrade = "to_v2")]
struct User {
    id: String,
    first: String,
    last: String,
}

impl From<UserV2> for User {
    fn from(v2: UserV2) -> Self {
        User {
            id: v2.id,
            first: v2.first,
            last: v2.last,
        }
    }
}

fn to_v2(user: &User) -> UserV2 {
    UserV2 {
        id: user.id.clone(),
        first: user.first.clone(),
        last: user.last.clone(),
    }
}

#[test]
fn shapes_upgrade_and_downgrade_through_their_conversions() {
    let user = User {
        id: "1".into(),
        first: "Ada".into(),
        last: "King".into(),
    };
    assert!(user.downgrade(1).is_none());
    let v2 = user.downgrade(2).unwrap().unwrap();
    assert_eq!(v2, br#"{"id":"1","first":"Ada","last":"King"}"#);
    assert_eq!(<User as TitoModelTrait>::VERSION, 3);
    assert_eq!(<UserV2 as TitoShape>::VERSION, 2);
    let user = User::upgrade(1, br#"{"id":"1","name":"Ada Lovelace"}"#).unwrap();
    assert_eq!(user.last, "Lovelace");
    let user = User::upgrade(2, br#"{"id":"1","first":"Ada","last":"King"}"#).unwrap();
    assert_eq!(user.last, "King");
    assert_eq!(
        User::upgrade(1, br#"{"id":"1","name":"Plato"}"#).unwrap_err(),
        ShapeError::conversion(1, 2, "no space")
    );
    assert!(matches!(
        UserV1::read_version(2, b"{}"),
        Err(ShapeError::Newer { newest: 1 })
    ));
    assert!(matches!(
        User::upgrade(1, b"[]"),
        Err(ShapeError::Decode { .. })
    ));
}
