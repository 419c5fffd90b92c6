# A --no_python command: rank 1 complains on stderr and exits 7; rank 0 sleeps.
echo "rank $RANK starting"
if [ "$RANK" = "1" ]; then
  echo "fatal: disk on fire on rank 1" >&2
  exit 7
fi
sleep 600
