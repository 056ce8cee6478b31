// Configuration structs and JSON, through one list of fields per struct. Each struct has
//
//   template <class V> void fields(V& v) { v("heads", heads, config::at_least(1)); ... }
//
// and the same list drives strict reading (an unknown key, a value of the wrong type or out of
// range is an error naming the full key, what was expected and what arrived) and writing
// (every default filled in, as checkpoints and --print-config show it). Adding a key is one
// line; the reader and the writer cannot drift apart.
#pragma once

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "winnow/error.h"

namespace winnow::config {

using nlohmann::json;

[[noreturn]] inline void fail(const std::string& key, const std::string& expected,
                              const std::string& got) {
  throw Error(ErrorKind::invalid_argument,
              "config: key '" + key + "': expected " + expected + ", got " + got);
}

// A constraint on a number or a string, with the words an error message uses for it.
struct NumberRule {
  std::string expected;
  std::function<bool(double)> ok;
};
struct StringRule {
  std::string expected;
  std::function<bool(const std::string&)> ok;
};

inline std::string number_text(double x) {
  if (x == std::floor(x) && std::abs(x) < 1e15) return std::to_string(static_cast<long long>(x));
  return json(x).dump();
}

inline NumberRule at_least(double lo) {
  return {">= " + number_text(lo), [lo](double x) { return x >= lo; }};
}
inline NumberRule greater_than(double lo) {
  return {"> " + number_text(lo), [lo](double x) { return x > lo; }};
}
// [lo, hi) or [lo, hi].
inline NumberRule in_range(double lo, double hi, bool hi_inclusive) {
  return {"in [" + number_text(lo) + ", " + number_text(hi) + (hi_inclusive ? "]" : ")"),
          [=](double x) { return x >= lo && (hi_inclusive ? x <= hi : x < hi); }};
}
inline NumberRule with_words(NumberRule rule, const std::string& words) {
  rule.expected += " (" + words + ")";
  return rule;
}

inline std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}
inline StringRule one_of(std::vector<std::string> choices) {
  return {"one of " + join(choices), [choices](const std::string& s) {
            for (const std::string& c : choices) {
              if (s == c) return true;
            }
            return false;
          }};
}

template <class S, class = void>
struct has_fields : std::false_type {};
template <class S>
struct has_fields<S, std::void_t<decltype(std::declval<S&>().fields(std::declval<int&>()))>>
    : std::true_type {};
template <class T, class = void>
struct is_struct_list : std::false_type {};
template <class T>
struct is_struct_list<T, std::void_t<typename T::value_type>> : has_fields<typename T::value_type> {};

// Reads one JSON object into a struct's fields. finish() rejects keys no field claimed;
// unclaimed() hands them to a caller that owns a second set of keys in the same object
// (the attention mechanisms' own options sit beside the common ones).
class Reader {
 public:
  Reader(const json& j, std::string path) : j_(j), path_(std::move(path)) {
    if (!j_.is_object()) fail(path_.empty() ? "(top level)" : path_, "an object", j_.dump());
  }

  std::string key(const std::string& name) const { return path_.empty() ? name : path_ + "." + name; }
  const std::string& path() const { return path_; }

  template <class T>
  void operator()(const char* name, T& out) {
    read(name, out, nullptr, nullptr);
  }
  template <class T>
  void operator()(const char* name, T& out, const NumberRule& rule) {
    read(name, out, &rule, nullptr);
  }
  template <class T>
  void operator()(const char* name, T& out, const StringRule& rule) {
    read(name, out, nullptr, &rule);
  }

  // Marks `name` as known without converting it; returns its value, or nullptr when absent.
  const json* claim(const char* name) {
    seen_.insert(name);
    auto it = j_.find(name);
    return it == j_.end() ? nullptr : &*it;
  }

  void finish() const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      if (!seen_.count(it.key())) {
        throw Error(ErrorKind::invalid_argument, "config: unknown key '" + key(it.key()) + "'");
      }
    }
  }

  json unclaimed() const {
    json rest = json::object();
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      if (!seen_.count(it.key())) rest[it.key()] = it.value();
    }
    return rest;
  }

 private:
  template <class T>
  void read(const char* name, T& out, const NumberRule* number_rule, const StringRule* string_rule) {
    seen_.insert(name);
    auto it = j_.find(name);
    if (it == j_.end()) return;
    convert(*it, key(name), out, number_rule, string_rule);
  }

  static void check_number(const std::string& k, double x, const json& v, const NumberRule* rule) {
    if (rule != nullptr && rule->ok && !rule->ok(x)) fail(k, rule->expected, v.dump());
  }

  template <class T>
  static void convert(const json& v, const std::string& k, T& out, const NumberRule* number_rule,
                      const StringRule* string_rule) {
    if constexpr (std::is_same_v<T, bool>) {
      if (!v.is_boolean()) fail(k, "true or false", v.dump());
      out = v.get<bool>();
    } else if constexpr (std::is_integral_v<T>) {
      if (!v.is_number_integer()) fail(k, "an integer", v.dump());
      if (std::is_unsigned_v<T> && !v.is_number_unsigned() && v.get<std::int64_t>() < 0) {
        fail(k, "an integer >= 0", v.dump());
      }
      if (v.is_number_unsigned() || v.get<std::int64_t>() >= 0) {
        const auto x = v.get<std::uint64_t>();
        if (x > static_cast<std::uint64_t>(std::numeric_limits<T>::max())) {
          fail(k, "an integer that fits " + std::to_string(sizeof(T) * 8) + " bits", v.dump());
        }
        out = static_cast<T>(x);
      } else {
        const auto x = v.get<std::int64_t>();
        if (x < static_cast<std::int64_t>(std::numeric_limits<T>::min()) ||
            x > static_cast<std::int64_t>(std::numeric_limits<T>::max())) {
          fail(k, "an integer that fits " + std::to_string(sizeof(T) * 8) + " bits", v.dump());
        }
        out = static_cast<T>(x);
      }
      check_number(k, static_cast<double>(out), v, number_rule);
    } else if constexpr (std::is_floating_point_v<T>) {
      if (!v.is_number()) fail(k, "a number", v.dump());
      out = v.get<T>();
      check_number(k, static_cast<double>(out), v, number_rule);
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (!v.is_string()) fail(k, "a string", v.dump());
      out = v.get<std::string>();
      if (string_rule != nullptr && string_rule->ok && !string_rule->ok(out)) {
        fail(k, string_rule->expected, v.dump());
      }
    } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      if (!v.is_array()) fail(k, "a list of strings", v.dump());
      out.clear();
      for (std::size_t i = 0; i < v.size(); ++i) {
        std::string s;
        convert(v[i], k + "[" + std::to_string(i) + "]", s, nullptr, string_rule);
        out.push_back(std::move(s));
      }
    } else if constexpr (std::is_same_v<T, std::vector<double>> ||
                         std::is_same_v<T, std::vector<std::int64_t>>) {
      if (!v.is_array()) fail(k, "a list of numbers", v.dump());
      out.clear();
      for (std::size_t i = 0; i < v.size(); ++i) {
        typename T::value_type x{};
        convert(v[i], k + "[" + std::to_string(i) + "]", x, number_rule, nullptr);
        out.push_back(x);
      }
    } else if constexpr (std::is_same_v<T, json>) {
      out = v;
    } else if constexpr (std::is_same_v<T, std::map<std::string, double>>) {
      if (!v.is_object()) fail(k, "an object of name: number", v.dump());
      out.clear();
      for (auto it = v.begin(); it != v.end(); ++it) {
        double x = 0;
        convert(it.value(), k + "." + it.key(), x, number_rule, nullptr);
        out[it.key()] = x;
      }
    } else if constexpr (is_struct_list<T>::value) {
      // A list of structs.
      if (!v.is_array()) fail(k, "a list of objects", v.dump());
      out.clear();
      for (std::size_t i = 0; i < v.size(); ++i) {
        Reader r(v[i], k + "[" + std::to_string(i) + "]");
        typename T::value_type item;
        item.fields(r);
        r.finish();
        out.push_back(std::move(item));
      }
    } else {
      static_assert(has_fields<T>::value, "no JSON conversion for this field type");
      Reader r(v, k);
      out.fields(r);
      r.finish();
    }
  }

  const json& j_;
  std::string path_;
  std::set<std::string> seen_;
};

// Writes a struct's fields (all of them, defaults included) into a JSON object.
class Writer {
 public:
  template <class T, class... Rule>
  void operator()(const char* name, const T& value, const Rule&...) {
    out[name] = convert(value);
  }

  json out = json::object();

 private:
  template <class T>
  static json convert(const T& value) {
    if constexpr (has_fields<T>::value) {
      return write(value);
    } else if constexpr (std::is_same_v<T, json>) {
      return value;
    } else if constexpr (std::is_same_v<T, std::vector<std::string>> ||
                         std::is_same_v<T, std::map<std::string, double>>) {
      return json(value);
    } else if constexpr (std::is_class_v<T> && !std::is_same_v<T, std::string>) {
      json list = json::array();
      for (const auto& item : value) list.push_back(convert(item));
      return list;
    } else {
      return json(value);
    }
  }

 public:
  template <class S>
  static json write(const S& s) {
    S copy = s;  // fields() takes its members by reference; the writer only reads them
    Writer w;
    copy.fields(w);
    return std::move(w.out);
  }
};

// The keys of a struct's field list, in order.
struct KeyLister {
  std::vector<std::string> keys;
  template <class T, class... Rule>
  void operator()(const char* name, T&, const Rule&...) {
    keys.emplace_back(name);
  }
};
template <class S>
std::vector<std::string> keys_of() {
  KeyLister lister;
  S s;
  s.fields(lister);
  return lister.keys;
}

// Reads a whole struct strictly from `j`, which sits at `path` in the configuration.
template <class S>
S read(const json& j, const std::string& path) {
  S s;
  Reader r(j, path);
  s.fields(r);
  r.finish();
  return s;
}

template <class S>
json write(const S& s) {
  return Writer::write(s);
}

}  // namespace winnow::config
