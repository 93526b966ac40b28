# What an R kernel's snapshot holds: the global environment's variables, read by the
# wrapper with a silent execute just before a dump (kernel_wrapper/agents.py). It runs no
# code of the user's: no method is dispatched (class, typeof, attr, unclass and
# utils::object.size are primitives or C), active bindings and promises (delayedAssign)
# are listed, never read, and functions are left out, as the Python agent does. It
# answers one display_data whose text/plain is the JSON record, which the wrapper keeps
# from the clients. The wrapper fills in @TOP@ and @SECONDS@.
local({
  top <- @TOP@
  seconds <- @SECONDS@
  started <- proc.time()[["elapsed"]]
  env <- globalenv()
  names <- ls(env, sorted = FALSE)
  lazy <- rep(FALSE, length(names))
  if (length(names) && requireNamespace("rlang", quietly = TRUE)) {
    lazy <- rlang::env_binding_are_lazy(env, names) | rlang::env_binding_are_active(env, names)
  } else if (length(names)) {
    lazy <- vapply(names, bindingIsActive, logical(1), env = env)
  }
  found <- list()
  total <- 0
  partial <- FALSE
  for (i in seq_along(names)) {
    if (proc.time()[["elapsed"]] - started > seconds) {
      partial <- TRUE
      break
    }
    name <- names[[i]]
    if (lazy[[i]]) {
      found[[length(found) + 1L]] <- list(name = name, type = "promise", size = 0)
      next
    }
    record <- tryCatch({
      value <- get(name, envir = env, inherits = FALSE)
      if (is.function(value)) NULL else {
        size <- as.numeric(utils::object.size(value))
        entry <- list(name = name, type = paste(class(value), collapse = "/"), size = size)
        dims <- attr(value, "dim", exact = TRUE)
        if (is.data.frame(value)) {
          entry$shape <- I(c(.row_names_info(value, 2L), length(unclass(value))))
        } else if (!is.null(dims)) {
          entry$shape <- I(as.numeric(dims))
        } else if (is.atomic(value) || is.list(value)) {
          entry$length <- length(unclass(value))
        }
        if (is.atomic(value)) entry$dtype <- typeof(value)
        entry
      }
    }, error = function(e) list(name = name, type = "?", size = 0, error = conditionMessage(e)))
    if (!is.null(record)) {
      total <- total + record$size
      found[[length(found) + 1L]] <- record
    }
  }
  sizes <- vapply(found, function(r) r$size, numeric(1))
  largest <- found[order(-sizes)][seq_len(min(top, length(found)))]
  summary <- list(
    variables = largest,
    variable_count = length(found),
    variables_bytes = total,
    examined = length(found),
    partial = partial,
    seconds = proc.time()[["elapsed"]] - started
  )
  if (partial) {
    summary$partial_reason <- sprintf(
      "the global environment was not read within %g ms", seconds * 1000
    )
  }
  json <- jsonlite::toJSON(summary, auto_unbox = TRUE, digits = NA, null = "null")
  getOption("jupyter.base_display_func")(list("text/plain" = as.character(json)))
  invisible(NULL)
})
