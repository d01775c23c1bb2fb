// engine/: the Session and Generator layer above the backends (shared/DESIGN.md §1). The CPU
// reference session lives in src/cpu/ for now; the generator and backend selection land here.
namespace ck::engine {}
