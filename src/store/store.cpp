// store/: the packed expert store (shared/DESIGN.md §1 "Store"). Placeholder translation unit until
// the packer lands, so the library target exists.
namespace ck::store {}
