// A straight-line program of c10 dispatcher calls: what an fx graph of ATen / fxc operator
// calls becomes for the fx backend (backends/graph_program.py builds it from GraphModules).
//
// Every value lives in a slot (an IValue). An instruction either calls an operator through
// the dispatcher with a boxed stack assembled from slots and constants, takes an element of
// a list-returning op's result, or does integer arithmetic on sizes; afterwards it drops the
// slots whose last reader it was. run() executes the whole program with the GIL released:
// ~0.3 us of interpretation per node instead of the ~3 us a Python-level op call costs.
// Kernels implemented in Python still work: the dispatcher takes the GIL for them.
// torch's pybind11 and JIT value conversions, not torch/extension.h (the whole C++ frontend API).
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ScalarOps.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace py = pybind11;
using c10::IValue;

// How an operator argument is assembled at run time.
struct ArgSpec {
  enum Kind { kConst, kSlot, kList } kind = kConst;
  IValue value;                        // kConst
  int slot = -1;                       // kSlot
  // kList: each item is a slot (>= 0) or a constant (item_slots[i] == -1, value in item_consts[i]).
  std::vector<int> item_slots;
  std::vector<IValue> item_consts;
  enum ListKind { kInts, kTensors, kOptionalTensors, kFloats, kBools } list_kind = kInts;
};

enum class Arith { kAdd, kSub, kMul, kFloorDiv, kMod };

struct Instr {
  enum Kind { kOp, kGetItem, kArith } kind = kOp;
  std::optional<c10::OperatorHandle> op;
  std::string label;                   // fx node name, for error messages
  std::vector<ArgSpec> args;           // kOp: one per schema argument; kArith: two
  std::vector<int> outs;               // kOp: one slot per schema return (-1: unused)
  int src = -1, index = 0;             // kGetItem
  Arith arith = Arith::kAdd;           // kArith
  std::vector<int> frees;              // slots dead after this instruction
};

bool is_tensor_type(const c10::TypePtr& t) { return t->kind() == c10::TypeKind::TensorType; }

// A Python number given where the schema wants a Tensor (``aten.mul.Tensor(x, 0.5)`` in an
// exported graph) becomes a wrapped-number 0-dim tensor, as Python's argument parser does.
IValue const_arg(py::handle obj, const c10::TypePtr& type) {
  if (is_tensor_type(type) && !THPVariable_Check(obj.ptr())) {
    at::Scalar s;
    if (py::isinstance<py::bool_>(obj)) s = at::Scalar(obj.cast<bool>());
    else if (py::isinstance<py::int_>(obj)) s = at::Scalar(obj.cast<int64_t>());
    else if (py::isinstance<py::float_>(obj)) s = at::Scalar(obj.cast<double>());
    else throw std::invalid_argument("constant for a Tensor argument must be a tensor or a number");
    at::Tensor t = c10::scalar_to_tensor(s);
    t.unsafeGetTensorImpl()->set_wrapped_number(true);
    return t;
  }
  return torch::jit::toIValue(obj, type);
}

ArgSpec::ListKind list_kind_of(const c10::TypePtr& type, const std::string& where) {
  c10::TypePtr t = type;
  if (t->kind() == c10::TypeKind::OptionalType) t = t->expectRef<c10::OptionalType>().getElementType();
  if (t->kind() != c10::TypeKind::ListType) throw std::invalid_argument(where + ": not a list argument");
  const auto& el = t->expectRef<c10::ListType>().getElementType();
  switch (el->kind()) {
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType: return ArgSpec::kInts;
    case c10::TypeKind::TensorType: return ArgSpec::kTensors;
    case c10::TypeKind::FloatType: return ArgSpec::kFloats;
    case c10::TypeKind::BoolType: return ArgSpec::kBools;
    case c10::TypeKind::OptionalType:
      if (is_tensor_type(el->expectRef<c10::OptionalType>().getElementType())) return ArgSpec::kOptionalTensors;
      break;
    default: break;
  }
  throw std::invalid_argument(where + ": unsupported list element type " + el->str());
}

int64_t as_int(const IValue& v) {
  if (v.isInt()) return v.toInt();
  if (v.isSymInt()) return v.toSymInt().expect_int();
  if (v.isBool()) return v.toBool();
  throw std::runtime_error("expected an integer, got " + v.tagKind());
}

class GraphProgram {
 public:
  explicit GraphProgram(int num_slots) : init_(num_slots) {}

  void set_constant(int slot, py::handle value) {
    check_slot(slot);
    init_[slot] = torch::jit::toIValue(value, c10::AnyType::get());
  }

  void set_inputs(std::vector<int> slots) {
    for (int s : slots) check_slot(s);
    inputs_ = std::move(slots);
  }

  void set_outputs(std::vector<int> slots) {
    for (int s : slots) check_slot(s);
    outputs_ = std::move(slots);
  }

  // args: one (kind, payload) tuple per schema argument, in schema order (keyword-only ones too):
  // ("const", obj) | ("default", None) | ("slot", i) | ("list", [("slot", i) | ("const", obj), ...]).
  void add_op(const std::string& name, const std::string& overload, py::list args, std::vector<int> outs,
              std::vector<int> frees, const std::string& label) {
    Instr ins;
    ins.kind = Instr::kOp;
    ins.label = label;
    ins.op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const auto& schema = ins.op->schema();
    const auto& formal = schema.arguments();
    if (schema.is_vararg() || schema.is_varret())
      throw std::invalid_argument(label + ": vararg schemas are not supported");
    if (py::len(args) != formal.size())
      throw std::invalid_argument(label + ": expected " + std::to_string(formal.size()) + " arguments, got " +
                                  std::to_string(py::len(args)));
    if (outs.size() != schema.returns().size())
      throw std::invalid_argument(label + ": expected " + std::to_string(schema.returns().size()) + " output slots");
    for (size_t i = 0; i < formal.size(); ++i) {
      const std::string where = label + " argument '" + formal[i].name() + "'";
      auto item = args[i].cast<py::tuple>();
      const auto kind = item[0].cast<std::string>();
      ArgSpec a;
      if (kind == "const") {
        a.kind = ArgSpec::kConst;
        a.value = const_arg(item[1], formal[i].type());
      } else if (kind == "default") {
        if (!formal[i].default_value()) throw std::invalid_argument(where + " has no default");
        a.kind = ArgSpec::kConst;
        a.value = *formal[i].default_value();
      } else if (kind == "slot") {
        a.kind = ArgSpec::kSlot;
        a.slot = item[1].cast<int>();
        check_slot(a.slot);
      } else if (kind == "list") {
        a.kind = ArgSpec::kList;
        a.list_kind = list_kind_of(formal[i].type(), where);
        for (auto el : item[1].cast<py::list>()) {
          auto e = el.cast<py::tuple>();
          if (e[0].cast<std::string>() == "slot") {
            a.item_slots.push_back(e[1].cast<int>());
            check_slot(a.item_slots.back());
            a.item_consts.emplace_back();
          } else {
            a.item_slots.push_back(-1);
            a.item_consts.push_back(torch::jit::toIValue(e[1], c10::AnyType::get()));
          }
        }
      } else {
        throw std::invalid_argument(where + ": unknown argument kind " + kind);
      }
      ins.args.push_back(std::move(a));
    }
    for (int s : outs)
      if (s >= 0) check_slot(s);
    ins.outs = std::move(outs);
    set_frees(ins, std::move(frees));
    code_.push_back(std::move(ins));
  }

  void add_getitem(int src, int index, int dst, std::vector<int> frees, const std::string& label) {
    check_slot(src);
    check_slot(dst);
    Instr ins;
    ins.kind = Instr::kGetItem;
    ins.label = label;
    ins.src = src;
    ins.index = index;
    ins.outs = {dst};
    set_frees(ins, std::move(frees));
    code_.push_back(std::move(ins));
  }

  // op: "add" | "sub" | "mul" | "floordiv" | "mod"; a, b: ("slot", i) | ("const", int)
  void add_arith(const std::string& op, py::tuple a, py::tuple b, int dst, std::vector<int> frees,
                 const std::string& label) {
    Instr ins;
    ins.kind = Instr::kArith;
    ins.label = label;
    if (op == "add") ins.arith = Arith::kAdd;
    else if (op == "sub") ins.arith = Arith::kSub;
    else if (op == "mul") ins.arith = Arith::kMul;
    else if (op == "floordiv") ins.arith = Arith::kFloorDiv;
    else if (op == "mod") ins.arith = Arith::kMod;
    else throw std::invalid_argument(label + ": unsupported integer operation " + op);
    for (py::tuple t : {a, b}) {
      ArgSpec s;
      if (t[0].cast<std::string>() == "slot") {
        s.kind = ArgSpec::kSlot;
        s.slot = t[1].cast<int>();
        check_slot(s.slot);
      } else {
        s.kind = ArgSpec::kConst;
        s.value = IValue(t[1].cast<int64_t>());
      }
      ins.args.push_back(std::move(s));
    }
    check_slot(dst);
    ins.outs = {dst};
    set_frees(ins, std::move(frees));
    code_.push_back(std::move(ins));
  }

  size_t size() const { return code_.size(); }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) const {
    if (inputs.size() != inputs_.size())
      throw std::invalid_argument("expected " + std::to_string(inputs_.size()) + " input tensors, got " +
                                  std::to_string(inputs.size()));
    std::vector<IValue> slots(init_);
    for (size_t i = 0; i < inputs.size(); ++i) slots[inputs_[i]] = inputs[i];
    torch::jit::Stack stack;
    stack.reserve(16);
    for (const Instr& ins : code_) {
      switch (ins.kind) {
        case Instr::kOp: {
          stack.clear();
          for (const ArgSpec& a : ins.args) push_arg(a, slots, stack);
          try {
            ins.op->callBoxed(stack);
          } catch (c10::Error& e) {  // keeps its type (ValueError, IndexError...); names the graph node
            e.add_context("in graph node " + ins.label + " (" + ins.op->schema().operator_name().name + ")");
            throw;
          }
          for (size_t r = 0; r < ins.outs.size(); ++r)
            if (ins.outs[r] >= 0) slots[ins.outs[r]] = std::move(stack[r]);
          break;
        }
        case Instr::kGetItem: {
          const IValue& v = slots[ins.src];
          if (v.isTensorList()) slots[ins.outs[0]] = v.toTensorList().get(ins.index);
          else if (v.isList()) slots[ins.outs[0]] = v.toListRef().at(ins.index);
          else if (v.isTuple()) slots[ins.outs[0]] = v.toTupleRef().elements().at(ins.index);
          else throw std::runtime_error(ins.label + ": getitem of a " + v.tagKind());
          break;
        }
        case Instr::kArith: {
          const int64_t x = as_int(value_of(ins.args[0], slots)), y = as_int(value_of(ins.args[1], slots));
          int64_t r = 0;
          switch (ins.arith) {
            case Arith::kAdd: r = x + y; break;
            case Arith::kSub: r = x - y; break;
            case Arith::kMul: r = x * y; break;
            case Arith::kFloorDiv:
            case Arith::kMod: {
              if (y == 0) throw std::runtime_error(ins.label + ": integer division by zero");
              int64_t q = x / y;
              if ((x % y != 0) && ((x < 0) != (y < 0))) --q;  // Python floors
              r = ins.arith == Arith::kFloorDiv ? q : x - q * y;
              break;
            }
          }
          slots[ins.outs[0]] = r;
          break;
        }
      }
      for (int s : ins.frees) slots[s] = IValue();
    }
    std::vector<at::Tensor> out;
    out.reserve(outputs_.size());
    for (int s : outputs_) {
      if (!slots[s].isTensor()) throw std::runtime_error("program output is not a tensor: " + slots[s].tagKind());
      out.push_back(slots[s].toTensor());
    }
    return out;
  }

 private:
  void check_slot(int s) const {
    if (s < 0 || s >= static_cast<int>(init_.size()))
      throw std::out_of_range("slot " + std::to_string(s) + " out of range");
  }

  void set_frees(Instr& ins, std::vector<int> frees) const {
    for (int s : frees) check_slot(s);
    ins.frees = std::move(frees);
  }

  static const IValue& value_of(const ArgSpec& a, const std::vector<IValue>& slots) {
    return a.kind == ArgSpec::kSlot ? slots[a.slot] : a.value;
  }

  static void push_arg(const ArgSpec& a, const std::vector<IValue>& slots, torch::jit::Stack& stack) {
    if (a.kind != ArgSpec::kList) {
      stack.push_back(value_of(a, slots));
      return;
    }
    const size_t n = a.item_slots.size();
    auto item = [&](size_t i) -> const IValue& {
      return a.item_slots[i] >= 0 ? slots[a.item_slots[i]] : a.item_consts[i];
    };
    switch (a.list_kind) {
      case ArgSpec::kInts: {
        std::vector<int64_t> v(n);
        for (size_t i = 0; i < n; ++i) v[i] = as_int(item(i));
        stack.emplace_back(std::move(v));
        break;
      }
      case ArgSpec::kTensors: {
        c10::List<at::Tensor> v;
        v.reserve(n);
        for (size_t i = 0; i < n; ++i) v.push_back(item(i).toTensor());
        stack.emplace_back(std::move(v));
        break;
      }
      case ArgSpec::kOptionalTensors: {
        c10::List<std::optional<at::Tensor>> v;
        v.reserve(n);
        for (size_t i = 0; i < n; ++i) {
          const IValue& x = item(i);
          v.push_back(x.isNone() ? std::optional<at::Tensor>() : std::optional<at::Tensor>(x.toTensor()));
        }
        stack.emplace_back(std::move(v));
        break;
      }
      case ArgSpec::kFloats: {
        std::vector<double> v(n);
        for (size_t i = 0; i < n; ++i) v[i] = item(i).isDouble() ? item(i).toDouble() : double(as_int(item(i)));
        stack.emplace_back(std::move(v));
        break;
      }
      case ArgSpec::kBools: {
        c10::List<bool> v;
        v.reserve(n);
        for (size_t i = 0; i < n; ++i) v.push_back(item(i).toBool());
        stack.emplace_back(std::move(v));
        break;
      }
    }
  }

  std::vector<IValue> init_;  // constants (parameters) preset; everything else None
  std::vector<int> inputs_, outputs_;
  std::vector<Instr> code_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<GraphProgram>(m, "GraphProgram")
      .def(py::init<int>(), py::arg("num_slots"))
      .def("set_constant", &GraphProgram::set_constant)
      .def("set_inputs", &GraphProgram::set_inputs)
      .def("set_outputs", &GraphProgram::set_outputs)
      .def("add_op", &GraphProgram::add_op)
      .def("add_getitem", &GraphProgram::add_getitem)
      .def("add_arith", &GraphProgram::add_arith)
      .def("__len__", &GraphProgram::size)
      .def("run", &GraphProgram::run, py::call_guard<py::gil_scoped_release>());
}
