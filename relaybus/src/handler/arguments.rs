//! What a handler takes after the event, and the implementations of [`Handler`] for functions
//! of up to four such arguments.

use std::{any::TypeId, future::Future};

use futures::future::BoxFuture;

use super::{Handler, HandlerContext};
use crate::{
    error::BoxError,
    event::Event,
    state::{State, StateMap},
    store::Store,
};

/// What a handler may take after the event: its [`HandlerContext`], of the store it runs on,
/// or a [`State`] value given to the bus.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be an argument of a handler",
    label = "not a handler argument",
    note = "a handler takes the event, then any of `HandlerContext` and `State<T>` (for a `T` given with `RelayBusBuilder::state`)"
)]
pub trait HandlerArgument: seal::Argument + Send + 'static {}

/// The arguments of a handler after the event, as a tuple of [`HandlerArgument`]s.
pub trait HandlerArguments: seal::Arguments + Send + 'static {}

/// What the argument traits do, out of users' reach so that they can grow.
#[allow(unreachable_pub)]
pub(crate) mod seal {
    use std::any::{Any, TypeId};

    use super::StateMap;
    use crate::store::Store;

    /// What an argument of a handler needs from the bus it is subscribed to.
    #[derive(Debug, Clone, Copy)]
    pub enum Need {
        /// A context of this store.
        Context(StoreTag),
        /// A state value of this type.
        State {
            type_id: fn() -> TypeId,
            type_name: &'static str,
        },
    }

    /// The store a subscription's handler is written for.
    #[derive(Clone, Copy)]
    pub struct StoreTag {
        pub(crate) type_id: fn() -> TypeId,
        pub(crate) name: &'static str,
    }

    impl StoreTag {
        pub(crate) fn of<S: Store>() -> Self {
            StoreTag {
                type_id: TypeId::of::<S>,
                name: S::NAME,
            }
        }
    }

    /// What one run hands the arguments: the context, boxed, and the bus's state.
    pub struct Parts<'a> {
        pub(crate) context: &'a (dyn Any + Send),
        pub(crate) state: &'a StateMap,
    }

    impl std::fmt::Debug for Parts<'_> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Parts")
                .field("state", &self.state)
                .finish_non_exhaustive()
        }
    }

    impl std::fmt::Debug for StoreTag {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.name)
        }
    }

    pub trait Argument: Sized {
        /// What the argument needs from the bus, checked when the bus is built.
        fn need() -> Option<Need>;
        /// The argument for one run.
        fn take(parts: &Parts<'_>) -> Result<Self, String>;
    }

    pub trait Arguments: Sized {
        fn needs() -> Vec<Need>;
        fn take(parts: &Parts<'_>) -> Result<Self, String>;
    }
}

impl<S: Store> seal::Argument for HandlerContext<S> {
    fn need() -> Option<Need> {
        Some(Need::Context(StoreTag::of::<S>()))
    }

    fn take(parts: &seal::Parts<'_>) -> Result<Self, String> {
        // `build` refuses a subscription of another store, so the context is of `S`.
        parts
            .context
            .downcast_ref::<HandlerContext<S>>()
            .cloned()
            .ok_or_else(|| {
                format!(
                    "handler context of another store than {}; subscribe the handler to a bus \
                     of that store",
                    S::NAME
                )
            })
    }
}

impl<S: Store> HandlerArgument for HandlerContext<S> {}

impl<T: Clone + Send + Sync + 'static> seal::Argument for State<T> {
    fn need() -> Option<Need> {
        Some(Need::State {
            type_id: TypeId::of::<T>,
            type_name: std::any::type_name::<T>(),
        })
    }

    fn take(parts: &seal::Parts<'_>) -> Result<Self, String> {
        // `build` refuses a handler whose state is missing, so the value is there.
        parts.state.get::<T>().map(State).ok_or_else(|| {
            format!(
                "no state of type {} was given to the bus; add it with `RelayBusBuilder::state`",
                std::any::type_name::<T>()
            )
        })
    }
}

impl<T: Clone + Send + Sync + 'static> HandlerArgument for State<T> {}

macro_rules! handler_arities {
    ($($arg:ident),*) => {
        impl<E, F, Fut, $($arg,)*> Handler<E, ($($arg,)*)> for F
        where
            E: Event,
            F: Fn(E, $($arg,)*) -> Fut + Send + Sync + 'static,
            Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
            $($arg: HandlerArgument,)*
        {
            #[allow(non_snake_case)]
            fn call(
                &self,
                event: E,
                ($($arg,)*): ($($arg,)*),
            ) -> BoxFuture<'static, Result<(), BoxError>> {
                Box::pin((self)(event, $($arg,)*))
            }
        }

        impl<$($arg: HandlerArgument,)*> seal::Arguments for ($($arg,)*) {
            fn needs() -> Vec<Need> {
                let needs: [Option<Need>; 0 $(+ { let _ = stringify!($arg); 1 })*] =
                    [$(<$arg as seal::Argument>::need(),)*];
                needs.into_iter().flatten().collect()
            }

            #[allow(clippy::unused_unit)]
            fn take(_parts: &seal::Parts<'_>) -> Result<Self, String> {
                Ok(($(<$arg as seal::Argument>::take(_parts)?,)*))
            }
        }

        impl<$($arg: HandlerArgument,)*> HandlerArguments for ($($arg,)*) {}
    };
}

use seal::{Need, StoreTag};

handler_arities!();
handler_arities!(A1);
handler_arities!(A1, A2);
handler_arities!(A1, A2, A3);
handler_arities!(A1, A2, A3, A4);
