//! Application state for handlers: what [`RelayBusBuilder::state`](crate::RelayBusBuilder::state)
//! gives, and the [`State`] argument that takes it.

use std::{
    any::{Any, TypeId},
    collections::HashMap,
    fmt,
    sync::Arc,
};

/// A handler argument that takes a value of the application's state, given to the bus with
/// [`RelayBusBuilder::state`](crate::RelayBusBuilder::state): a database handle, a client, a
/// configuration. The handler gets a clone for each attempt, so share what is costly to clone
/// behind an `Arc` (most clients already are).
///
/// ```no_run
/// # use relaybus::{BoxError, HandlerContext, RelayBus, State, Subscription};
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct OrderPlaced { order_id: String }
/// # impl relaybus::Event for OrderPlaced { const TYPE: &'static str = "order.placed.v1"; }
/// #[derive(Clone)]
/// struct Mailer {
///     sender: String,
/// }
///
/// # fn example(store: relaybus::MongoEventStore) -> Result<(), relaybus::ConfigurationError> {
/// let bus = RelayBus::builder(store)
///     .state(Mailer { sender: "shop@example.com".into() })
///     .subscribe(Subscription::new(
///         "send-confirmation",
///         |event: OrderPlaced, State(mailer): State<Mailer>| async move {
///             println!("{} confirms order {}", mailer.sender, event.order_id);
///             Ok::<(), BoxError>(())
///         },
///     ))
///     .build()?;
/// # Ok(())
/// # }
/// ```
///
/// A handler that asks for a type the bus was never given is refused by
/// [`RelayBusBuilder::build`](crate::RelayBusBuilder::build), with
/// [`ConfigurationError::MissingState`](crate::ConfigurationError::MissingState).
#[derive(Debug, Clone, Copy, Default)]
pub struct State<T>(pub T);

impl<T> std::ops::Deref for State<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// The values given to a bus's handlers, one per type.
#[derive(Clone, Default)]
pub(crate) struct StateMap {
    values: HashMap<TypeId, Entry>,
}

#[derive(Clone)]
struct Entry {
    value: Arc<dyn Any + Send + Sync>,
    type_name: &'static str,
}

impl StateMap {
    /// Adds `value`; `Err` with the type's name when the map has a value of that type already.
    pub(crate) fn insert<T: Clone + Send + Sync + 'static>(
        &mut self,
        value: T,
    ) -> Result<(), &'static str> {
        let type_name = std::any::type_name::<T>();
        match self.values.entry(TypeId::of::<T>()) {
            std::collections::hash_map::Entry::Occupied(_) => Err(type_name),
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(Entry {
                    value: Arc::new(value),
                    type_name,
                });
                Ok(())
            }
        }
    }

    pub(crate) fn contains(&self, type_id: TypeId) -> bool {
        self.values.contains_key(&type_id)
    }

    /// A clone of the value of type `T`, if the map has one.
    pub(crate) fn get<T: Clone + 'static>(&self) -> Option<T> {
        self.values
            .get(&TypeId::of::<T>())
            .and_then(|entry| entry.value.downcast_ref::<T>())
            .cloned()
    }
}

impl fmt::Debug for StateMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names: Vec<_> = self.values.values().map(|e| e.type_name).collect();
        names.sort_unstable();
        f.debug_set().entries(names).finish()
    }
}
