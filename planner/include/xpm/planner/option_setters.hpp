// xpm/planner/option_setters.hpp — chainable setters beside the plain fields of an options
// struct, in LibTorch's idiom (TORCH_ARG) while the fields stay assignable:
//
//   struct MyOptions {
//     std::int64_t steps = 10;
//     XPM_OPTION_SETTER(MyOptions, std::int64_t, steps)  // MyOptions& set_steps(std::int64_t)
//   };
//   auto options = MyOptions().set_steps(60);             // or: options.steps = 60;
#pragma once

#include <utility>

/// A comma inside a macro argument (std::map<K XPM_COMMA V>).
#define XPM_COMMA ,

/// Declares `Owner& set_<field>(Type value)`: assigns the field and returns *this.
#define XPM_OPTION_SETTER(Owner, Type, field) \
  Owner& set_##field(Type value) {            \
    field = std::move(value);                 \
    return *this;                             \
  }
