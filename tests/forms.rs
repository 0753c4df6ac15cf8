//! Programs that use the derive macros' attribute forms, each in a module of its own as an
//! application would write them: they compile (the compile-fail side is `ui-tests`) and the
//! generated code behaves as its attributes say.

mod every_attribute_form;
mod inbox_model;
mod index_values;
mod queue_events;
mod shapes;
mod short_names;
