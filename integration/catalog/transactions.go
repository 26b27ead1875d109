package catalog

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/apache/iceberg-go/table"
)

// commitTransaction commits several tables all or nothing. iceberg-go's SQL
// catalog commits one table per call, so atomicity comes from this server:
// the write lock excludes every other mutation, all requirements and updates
// are checked before the first commit, and if a later commit still fails the
// earlier ones are undone by moving their pointers back.
func (s *Server) commitTransaction(c *call) (int, any, error) {
	var req struct {
		TableChanges []commitTableRequest `json:"table-changes"`
	}
	if err := c.decode(&req); err != nil {
		return 0, nil, err
	}
	if len(req.TableChanges) == 0 {
		return 0, nil, badRequest("table-changes must not be empty")
	}
	idents := make([]table.Identifier, len(req.TableChanges))
	for i, ch := range req.TableChanges {
		if ch.Identifier == nil {
			return 0, nil, badRequest("table-changes[%d] has no identifier", i)
		}
		id, err := ch.Identifier.toIdent()
		if err != nil {
			return 0, nil, err
		}
		if slices.ContainsFunc(idents[:i], func(o table.Identifier) bool { return slices.Equal(o, id) }) {
			return 0, nil, badRequest("table %s appears more than once", strings.Join(id, "."))
		}
		idents[i] = id
	}
	bases := make([]string, len(idents))
	for i, id := range idents {
		base, err := s.checkCommit(c.ctx, id, req.TableChanges[i])
		if err != nil {
			return 0, nil, err
		}
		bases[i] = base
	}

	committed := make([]string, 0, len(idents)) // new pointers, for an undo
	for i, id := range idents {
		ch := req.TableChanges[i]
		_, loc, err := s.cat.CommitTable(c.ctx, id, ch.Requirements, ch.Updates)
		if err == nil {
			committed = append(committed, loc)

			continue
		}
		if undoErr := s.undoCommits(c, idents[:i], bases[:i], committed); undoErr != nil {
			return 0, nil, newAPIError(http.StatusInternalServerError, typeCommitUnknown,
				"commit of %s failed (%v) and undoing earlier commits failed: %v", strings.Join(id, "."), err, undoErr)
		}

		return 0, nil, err
	}

	return http.StatusNoContent, nil, nil
}

// undoCommits restores the pointers of already committed tables: a table the
// transaction created is dropped, others go back to their base metadata.
func (s *Server) undoCommits(c *call, idents []table.Identifier, bases, committed []string) error {
	var errs []error
	for i, id := range idents {
		newLoc := committed[i]
		if bases[i] == "" {
			errs = append(errs, s.cat.DropTable(c.ctx, id))

			continue
		}
		ok, err := s.swapLocation(c.ctx, id, rowTable, newLoc, bases[i])
		if err == nil && !ok {
			err = fmt.Errorf("table %s moved during undo", strings.Join(id, "."))
		}
		errs = append(errs, err)
	}

	return errors.Join(errs...)
}
