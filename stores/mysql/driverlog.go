package mysql

import (
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// driverLogger is the go-sql-driver Logger that writes to the store's log.
// The driver logs a connection it gives up on (a write to a socket the
// server closed, a malformed packet) and goes on: the store's own errors
// say what a request lost, so these are warnings. The password is kept
// out, as from the store's errors.
type driverLogger struct {
	log           *zap.Logger
	dsn, password string
}

func (l driverLogger) Print(v ...any) {
	msg := sqlstore.RedactError(errors.New(fmt.Sprint(v...)), l.dsn, l.password).Error()
	l.log.Warn("mysql driver", zap.String("message", msg))
}
